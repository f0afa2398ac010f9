"""kvfork: forkable, batched llama.cpp inference.

Branches share one KV-cache prefix (a fork copies no tensors), each with its own sampler,
grammar, biases and perplexity; a BranchStore advances N branches in one ``llama_decode``.
Everything that runs the model is async first, with a blocking ``*_sync`` twin.

llama.cpp's log goes to ``logging.getLogger("kvfork")`` (quiet by default: warnings and
errors only, and no handler). ``set_log_level(logging.DEBUG)`` forwards everything.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from typing import Any

from . import _backends, _native, patterns
from ._chat import Chat
from ._models import default_chat_model_path, default_model_path
from ._native import (
    Branch,
    BranchDisposedError,
    BranchStore,
    ChatTemplateError,
    Context,
    ControlVector,
    DecodeError,
    FormattedChat,
    GrammarError,
    KvCacheFullError,
    KvforkError,
    KvforkWarning,
    LeaseExhaustedError,
    LoraAdapter,
    Model,
    ModelLoadError,
    Operation,
    PrefixCache,
    SamplingParams,
    StateFileError,
    Token,
    TokenStream,
    TokenStreamSync,
    create_context_sync,
    system_info,
)
from ._open import ContextOpening, create_context

# `Drafter` is a typing Protocol (what `generate(draft=...)` takes), re-exported for annotations.
from ._speculative import Drafter as Drafter
from ._speculative import DraftModel, PromptLookup, SpeculativeStream, SpeculativeStreamSync

# An ImportError in a subinterpreter: the extension's state is the main interpreter's.
_native._check_main_interpreter()

__version__: str = _native.__version__

# Where the release wheel's ggml modules are (its CPU variants and any GPU companion
# package's); a build from source links llama.cpp in and ignores this.
_native._set_module_dirs(_backends.module_dirs())

logging.getLogger("kvfork").addHandler(logging.NullHandler())

# At exit, a thread still holding a context (a daemon thread is frozen, not unwound) would
# leave its engine decoding while the process tears down: every context is closed first.
atexit.register(_native._close_all_contexts)
# A forked child has none of the engines' threads: the contexts it inherits are closed there.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_native._after_fork_in_child)


def set_log_level(level: int) -> None:
    """Forward llama.cpp log lines at ``level`` and above to the ``kvfork`` logger."""
    _native._set_log_level(int(level))


def json_schema_to_grammar(schema: dict[str, Any] | str) -> str:
    """GBNF grammar accepting exactly the JSON documents valid under ``schema``.

    Raises GrammarError for a schema that is not valid JSON or that llama.cpp cannot convert.
    """
    if isinstance(schema, dict):
        text = json.dumps(schema)
    elif isinstance(schema, str):
        text = schema
    else:
        raise TypeError("schema must be a dict or a JSON string")
    return _native.json_schema_to_grammar(text)


__all__ = [
    "Branch",
    "BranchDisposedError",
    "BranchStore",
    "Chat",
    "ChatTemplateError",
    "Context",
    "ContextOpening",
    "ControlVector",
    "DecodeError",
    "DraftModel",
    "FormattedChat",
    "GrammarError",
    "KvCacheFullError",
    "KvforkError",
    "KvforkWarning",
    "LeaseExhaustedError",
    "LoraAdapter",
    "Model",
    "ModelLoadError",
    "Operation",
    "PrefixCache",
    "PromptLookup",
    "SamplingParams",
    "SpeculativeStream",
    "SpeculativeStreamSync",
    "StateFileError",
    "Token",
    "TokenStream",
    "TokenStreamSync",
    "__version__",
    "create_context",
    "create_context_sync",
    "default_chat_model_path",
    "default_model_path",
    "json_schema_to_grammar",
    "patterns",
    "set_log_level",
    "system_info",
]
