"""The ott ops on a Vulkan device, driven from the tests through the test library ott_vk_test
(native/tests/ott-vk-test.cpp: ggml's backend API, every tensor in one buffer of the device).

ggml-vulkan picks its devices once per process, and it hides CPU devices (lavapipe) unless GGML_VK_VISIBLE_DEVICES
names them; the test process has usually initialized ggml already. So the library runs in a worker process of its
own (`python vk_ops.py LIB`), started with that variable, fed jobs over a pipe: `VkWorker.attn` sends one ubatch's
attention inputs and returns what the device computed, `VkWorker.seal` sends the state and returns it sealed,
`VkWorker.attn_seal` both in one graph, as a model's layer runs them.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

SCALARS = ("D", "H", "n_head", "T", "S", "NG", "NS", "ns", "n_tok", "n_stream", "outlier_num", "aux_cap", "scale",
           "v_rotate")  # fmt: skip
DEFS = """
const char * ott_vktest_device(int i);
int ott_vktest_attn(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags, int32_t G,
                    int32_t Gv, int64_t kgb, int64_t vgb);
int ott_vktest_seal(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags, int32_t G,
                    int32_t Gv, int64_t kgb, int64_t vgb);
int ott_vktest_attn_seal(const ott_cu_args * a, int device, int32_t kbits, int32_t vbits, int32_t flags, int32_t G,
                         int32_t Gv, int64_t kgb, int64_t vgb, int flags_only);
"""
STATE = ("ring", "sk", "sv", "pkv", "pmeta", "flags")  # what the seal writes


def _send(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _recv(f: BinaryIO) -> Any:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the Vulkan worker ended")
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(f.read(n))  # noqa: S301 (our own child process)


class VkWorker:
    """A worker process holding the test library on one Vulkan device (Vulkan0 by default)."""

    def __init__(self, lib: Path, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.proc = subprocess.Popen([sys.executable, __file__, str(lib)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)  # fmt: skip
        assert self.proc.stdin and self.proc.stdout
        self.device: str | None = _recv(self.proc.stdout)

    def attn(self, scalars: dict[str, float], head: dict[str, int], inputs: dict[str, np.ndarray],
             part_shape: tuple, out_shape: tuple) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """The attention partials and their merge on the device: (part, out); raises on a device error or refusal."""
        rc, part, out = self._job(("attn", scalars, head, inputs, (part_shape, out_shape)))
        if rc != 0:
            raise RuntimeError(f"ott_vktest_attn returned {rc} (-1 no device, -2 refused, -3 compute failed)")
        return part, out

    def seal(
        self, scalars: dict[str, float], head: dict[str, int], inputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The seal on the device: the state arrays (STATE) as it wrote them; raises on a device error or refusal."""
        rc, state = self._job(("seal", scalars, head, inputs, None))
        if rc != 0:
            raise RuntimeError(f"ott_vktest_seal returned {rc} (-1 no device, -2 refused, -3 compute failed)")
        return state

    def attn_seal(self, scalars: dict[str, float], head: dict[str, int], inputs: dict[str, np.ndarray],
                  part_shape: tuple, out_shape: tuple, flags_only: bool = False,
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:  # fmt: skip
        """The layer's partials, merge (given the layer's flags) and seal in one graph, as a model runs them:
        (part, out, the state arrays as the device left them). flags_only: no seal node after the merge (the state
        then shows whether the merge's dispatch sealed)."""
        rc, part, out, state = self._job(("attn_seal", scalars, head, inputs, (part_shape, out_shape, flags_only)))
        if rc != 0:
            raise RuntimeError(f"ott_vktest_attn_seal returned {rc} (-1 no device, -2 refused, -3 compute failed)")
        return part, out, state

    def _job(self, job: tuple) -> Any:
        assert self.proc.stdin and self.proc.stdout
        _send(self.proc.stdin, job)
        return _recv(self.proc.stdout)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _serve(lib_path: str) -> None:
    import cffi
    from cuda_ops import CDEF

    ffi = cffi.FFI()
    ffi.cdef(CDEF + DEFS)
    lib: Any = ffi.dlopen(lib_path)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # ggml's and the driver's prints must not reach the pipe
    d = lib.ott_vktest_device(0)
    _send(out, ffi.string(d).decode() if d != ffi.NULL else None)
    ctypes = {"q": "float *", "k": "float *", "v": "float *", "ring": "uint16_t *", "sk": "uint8_t *",
              "sv": "uint8_t *", "pkv": "uint16_t *", "pmeta": "int32_t *", "plan": "int32_t *",
              "flags": "int32_t *"}  # fmt: skip
    while True:
        try:
            kind, scalars, head, inputs, shapes = _recv(inp)
        except EOFError:
            return
        a = ffi.new("ott_cu_args *")
        for k, v in scalars.items():
            setattr(a, k, v)
        for k, arr in inputs.items():
            setattr(a, k, ffi.cast(ctypes[k], ffi.from_buffer(arr)))
        hargs = (head["kbits"], head["vbits"], head["flags"], head["G"], head["Gv"], head["kgb"], head["vgb"])
        if kind == "seal":
            rc = lib.ott_vktest_seal(a, 0, *hargs)
            _send(out, (rc, {k: inputs[k] for k in STATE}))
            continue
        part_shape, out_shape, *more = shapes
        part = np.full(part_shape, np.nan, np.float32)
        res = np.full(out_shape, np.nan, np.float32)
        a.part = ffi.cast("float *", ffi.from_buffer(part))
        a.out = ffi.cast("float *", ffi.from_buffer(res))
        if kind == "attn_seal":
            rc = lib.ott_vktest_attn_seal(a, 0, *hargs, int(more[0]))
            _send(out, (rc, part, res, {k: inputs[k] for k in STATE}))
            continue
        rc = lib.ott_vktest_attn(a, 0, *hargs)
        _send(out, (rc, part, res))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _serve(sys.argv[1])
