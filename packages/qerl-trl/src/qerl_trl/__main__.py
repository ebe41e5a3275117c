"""``python -m qerl_trl`` = ``qerl``."""

from .cli import main

main()
