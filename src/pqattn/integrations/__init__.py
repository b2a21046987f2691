"""Drop-in entry points for code written against other libraries."""
