"""`python -m flyd`: the same as the `flyd` console script."""

from flyd.main import main

main()
