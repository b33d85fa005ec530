"""The test suite is a package so that every folder imports the shared helpers as
``tests.helpers`` (a regular package: an unrelated installed ``tests`` module cannot shadow it)."""
