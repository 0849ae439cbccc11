"""Sphinx configuration of the jaxcomm site (``make docs-site``).

Everything the built pages load is in the build: the theme's files, the
search, and MathJax from the ``sphinx-mathjax-offline`` package. No page
loads a script, stylesheet or font from the network, and the build fetches
nothing (intersphinx is off).
"""

import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "_ext"))

# Importing jaxcomm must not look for accelerators or compile anything.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxcomm  # noqa: E402

project = "jaxcomm"
author = "the jaxcomm authors"
copyright = "the jaxcomm authors"  # noqa: A001
release = jaxcomm.__version__
version = release

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
  "sphinx-mathjax-offline",  # MathJax 3 copied into _static/mathjax
  "myst_parser",
  "jaxcomm_site",            # docs/_ext: api/ and examples/ pages
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]

# -- autodoc and napoleon ---------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = False
autodoc_inherit_docstrings = False
autosummary_generate = False  # the api/ pages are written by jaxcomm_site
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_preprocess_types = False

# -- Markdown (the README, ARCHITECTURE.md and docs/*.md) -------------------
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# -- Cross-references -------------------------------------------------------
# No inventories are fetched, so types of other libraries in signatures and
# docstrings cannot resolve; these patterns name them. Everything of
# jaxcomm's own must resolve (the build runs nitpicky, warnings as errors).
nitpick_ignore_regex = [
  # jaxcomm's private modules and what only they define (a docstring may
  # point at the implementation; the site documents public names only).
  (r"py:.*", r"(.*\.)?_[A-Za-z0-9]\w*(\..*)?"),
  # JAX, Optax, Flax, chex, NumPy, the standard library's typing helpers.
  (r"py:.*", r"(jax|jaxlib|jnp|lax|optax|flax|nnx|chex|np|numpy)(\..*)?"),
  (r"py:.*", r"(typing|collections\.abc|dataclasses|enum|types|inspect)\..*"),
  # Standard-library types that Sphinx does not know without an inventory.
  (r"py:class", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|"
                r"NamedTuple|Optional|Union|Literal|TypeVar)"),
  (r"py:class", r"(Array|ArrayTree|PyTree|Params|Updates|Shape|DType|"
                r"ScalarOrSchedule|Numeric|Mesh|NamedSharding|"
                r"PartitionSpec|Sharding|Device)"),
]

# -- HTML -------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxcomm {release}"
html_static_path = ["_static"]
html_css_files = ["jaxcomm.css"]
html_favicon = "_static/favicon.svg"  # else browsers ask for /favicon.ico
# The theme logs an error to the console when no default mode is set.
html_context = {"default_mode": "light"}
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
  "use_download_button": False,
  "use_fullscreen_button": False,
}
