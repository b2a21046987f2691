import sys

from pqattn.cli import main

sys.exit(main())
