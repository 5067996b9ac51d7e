"""`python -m twinkled` is the `twinkled` command."""

from twinkled.server.cli import main

main()
