"""`python -m nonomad`: the same as the `nonomad` CLI."""

from nonomad.cli import main

main()
