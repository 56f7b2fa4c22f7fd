"""`python -m flaps`: the same as the `flaps` console script."""

from flaps.main import main

main()
