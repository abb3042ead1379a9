"""Where fa_gen finds its templates and shipped specs.

Both live at the top of the source tree and are also installed as package data
(see pyproject.toml), so a plain non-editable `pip install .` finds them.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _in_source_checkout() -> bool:
    # An installed package's parent is site-packages, which may hold an unrelated
    # `templates/`; only a checkout has fa_gen's pyproject.toml beside the package.
    return (_PACKAGE_DIR.parent / "pyproject.toml").is_file()


def _data_dir(name: str) -> Path:
    # Source checkout: <repo>/<name>; installed wheel: fa_gen/_data/<name>.
    if _in_source_checkout():
        return _PACKAGE_DIR.parent / name
    return _PACKAGE_DIR / "_data" / name


def templates_dir() -> Path:
    return _data_dir("templates")


def specs_dir() -> Path:
    return _data_dir("specs")


def generated_dir() -> Path:
    """Committed renders of the shipped specs (only meaningful in a source checkout)."""
    return _PACKAGE_DIR.parent / "generated"
