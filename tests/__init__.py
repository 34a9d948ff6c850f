"""The test suite: ``.venv/bin/python -m pytest -q tests`` (pytest.ini puts the repository root on sys.path)."""
