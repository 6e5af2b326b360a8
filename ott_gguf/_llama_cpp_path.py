"""Imported at interpreter start by the `ott_gguf_llama_cpp.pth` file this package installs: points
llama-cpp-python at ott-gguf's patched libllama, so that a plain `import llama_cpp` (scripts, llama-cpp-python's
own server, LangChain or LlamaIndex integrations) loads it and can select the ott cache types. An explicit
LLAMA_CPP_LIB_PATH is left alone; OTT_GGUF_NATIVE_DIR selects another installed build, as in ott_gguf._lib."""

import os

_lib = os.path.join(os.environ.get("OTT_GGUF_NATIVE_DIR") or os.path.dirname(os.path.abspath(__file__)), "lib")
if os.path.isdir(_lib):
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", _lib)
