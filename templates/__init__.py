"""The Jinja2 CUDA templates, installed as the package data of tiledsl.templates (pyproject.toml)."""
