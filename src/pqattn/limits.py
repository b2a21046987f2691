"""The kernels' limits, defined once: the dispatch layer routes by them, the kernels size their
registers and workspaces by them. No Triton here, so reading them compiles nothing."""

MAX_COMBOS = 4096  # C**M up to which a row's combination scores and counts fit the cut kernel's registers
MAX_TREE_HEAVY = 8192  # the largest heavy the merge-tree selection serves
STATELESS_TREE_MAX_HEAVY = 256  # a call with no histogram kept takes the merge tree up to this heavy
