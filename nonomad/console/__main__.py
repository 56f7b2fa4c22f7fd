"""`python -m nonomad.console`: the same as the `nonomad-console` console script."""

from nonomad.console.main import main

main()
