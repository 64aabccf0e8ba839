"""XLA's persistent compilation cache for the command-line programs.

Each run of `serve.py`, `train.py` or the benchmark compiles its jitted programs before the first
token; with the cache on, a later run of the same shapes loads the executables instead (on a
2-core CPU, `serve.py generate`'s 19 s of compilation became 3 s). The library itself never turns
it on: a program that owns its process does, by calling `enable_compile_cache`.
"""

from __future__ import annotations

import logging
import pathlib

import jax

from jetspec_jax.default_model import cache_root

logger = logging.getLogger(__name__)


def enable_compile_cache() -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at `<cache_root()>/xla`, unless a directory is
    set already (`JAX_COMPILATION_CACHE_DIR`), and creates the directory either way. Call it
    before the first compilation.

    Returns:
        The cache directory in use; None when the cache is switched off
        (`JAX_ENABLE_COMPILATION_CACHE=false`), or when `cache_root()` cannot be found (no home
        directory) or the directory (`<cache_root()>/xla`, or `JAX_COMPILATION_CACHE_DIR`'s)
        cannot be created (a read-only cache, a file in its place): logged as a warning naming
        it, and the cache is off; a program given its model's path still runs.
    """
    if not jax.config.jax_enable_compilation_cache:
        return None
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        if "://" in chosen:  # a remote cache (gs://...): JAX's to reach
            return pathlib.Path(chosen)
        xla = pathlib.Path(chosen)
    else:
        try:
            root = cache_root()
        except OSError as e:
            logger.warning("%s; compiling without the persistent compilation cache", e.strerror)
            return None
        xla = root / "xla"
    try:
        # Created here, not by JAX at the first compilation: JAX's warning for a directory it
        # cannot create reads "Error reading persistent compilation cache entry", the one
        # docs/SERVING.md says a cut entry gives (delete it), and names neither cause nor remedy.
        xla.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning(
            "cannot create the compilation cache %s (%s): compiling without it; set "
            "JAX_COMPILATION_CACHE_DIR to a writable directory, or "
            "JAX_ENABLE_COMPILATION_CACHE=false",
            xla,
            e.strerror or e,
        )
        if chosen:
            jax.config.update("jax_compilation_cache_dir", None)
        return None
    jax.config.update("jax_compilation_cache_dir", str(xla))
    return xla
