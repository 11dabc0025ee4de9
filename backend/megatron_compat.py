"""Importing megatron-core safely.

megatron-core probes Transformer Engine with ``try: import transformer_engine except ImportError``.
A TE install that is present but broken (a wheel built for another CUDA or torch) raises other
errors (OSError, RuntimeError) from that import and takes megatron-core down with it. We probe TE
once; if it fails, we record why and make later imports raise ImportError, so megatron-core falls
back to its local (non-TE) layers, and the ``te`` attention backend reports the reason.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings

log = logging.getLogger(__name__)

_TE_STATE: dict[str, str | bool] = {}  # filled once per process by te_status()


def te_status() -> tuple[bool, str]:
    """(usable, reason). Usable means ``transformer_engine.pytorch`` imports."""
    if not _TE_STATE:
        try:
            importlib.import_module("transformer_engine.pytorch")
            _TE_STATE.update(ok=True, why="transformer_engine.pytorch imports")
        except ModuleNotFoundError as e:
            _TE_STATE.update(ok=False, why=f"Transformer Engine is not installed ({e})")
        except Exception as e:  # a broken install: hide it so megatron-core can import
            for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
                del sys.modules[name]
            sys.modules["transformer_engine"] = None  # type: ignore[assignment]  # import now raises ImportError
            _TE_STATE.update(
                ok=False, why=f"Transformer Engine is installed but does not import: {type(e).__name__}: {e}"
            )
            log.warning("%s; megatron-core will use its local layers", _TE_STATE["why"])
    return bool(_TE_STATE["ok"]), str(_TE_STATE["why"])


def import_megatron_module(name: str):
    """Import a megatron-core module after the TE probe, without its TE/Apex fallback warnings."""
    te_status()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        return importlib.import_module(name)
