"""The topic pages' examples (a package only so that pytest tells docs/conftest.py from
tests/conftest.py)."""
