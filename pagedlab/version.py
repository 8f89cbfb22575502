__version__ = "0.1.0"          # pyproject.toml's [project] version
