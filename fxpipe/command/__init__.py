"""The ``fxpipe`` command line (``cli``; ``factory`` turns its strings into a model and an
example): the package's own user, above the front door, the one place below the root that
imports the root package."""
