"""What the benchmark scripts share: the environment record, the Hopper check, GPU clock/power
sampling, the ratio bar plot, and writing results.json / results.md / results.png."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coda_cutlass as cc  # noqa: E402


def environment() -> dict[str, Any]:
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "?"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "coda_cutlass": cc.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def machine_line(env: dict[str, Any], what: str = "bf16") -> str:
    """The environment sentence that opens a results table (``what``: the data types measured)."""
    return f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, {what}. "


def config_label(choice: dict[str, Any] | None) -> str:
    """A tuner choice (config, raster, swizzle) as one table cell ("" when there is none)."""
    if not choice:
        return ""
    c = cc.KernelConfig.from_dict(choice["config"])
    return f"{c.name()} r={choice['raster']} s={choice['swizzle']}"


def require_hopper(script: str) -> None:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        sys.exit(f"{script} needs a Hopper GPU (sm_90)")
    torch.backends.cuda.matmul.allow_tf32 = False


class GpuSampler:
    """Samples SM clock and board power with nvidia-smi while the benchmark runs (H200s run large
    GEMMs at the power limit, so clocks move; the summary goes into the results)."""

    def __enter__(self) -> "GpuSampler":
        import subprocess
        import tempfile
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                 "-lms", "200"], stdout=self.log, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def summary(self) -> str:
        self.log.seek(0)
        rows = []
        for line in self.log.read().splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:
                continue
        if not rows:
            return "not sampled"
        def rng(i: int, unit: str) -> str:
            v = sorted(r[i] for r in rows)
            return f"{v[0]:.0f}-{v[-1]:.0f} {unit} (median {v[len(v) // 2]:.0f})"
        return f"SM clock {rng(0, 'MHz')}, power {rng(1, 'W')}, temperature {rng(2, 'C')}, {len(rows)} samples"


class Nvml:
    """The few NVML calls the benchmarks need (the board's energy counter, the SM clock), through
    ctypes: no pynvml dependency. Device 0: the benchmarks run on one GPU."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)))

    @staticmethod
    def _ok(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML call failed with code {rc}")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)))
        return v.value

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(v)))   # NVML_CLOCK_SM
        return v.value

    @contextlib.contextmanager
    def window(self) -> Iterator[dict[str, float]]:
        """Energy (J) and wall time (s) of the GPU work queued inside the ``with`` block: the device
        is synchronised on entry and exit, and the dict yielded is filled on exit."""
        out: dict[str, float] = {}
        torch.cuda.synchronize()
        e0, t0 = self.energy_mj(), time.perf_counter()
        yield out
        torch.cuda.synchronize()
        out["joules"] = (self.energy_mj() - e0) / 1000.0
        out["seconds"] = time.perf_counter() - t0


def ratio_bars(rows: list[dict[str, Any]], labels: list[str], series: list[tuple[str, str]], title: str,
               path: Path, *, figsize: tuple[float, float], rotation: int, fontsize: int,
               ylim: tuple[float, float] | None = None) -> None:
    """One group of bars per row: each series' time ratio to bare cuBLAS, with the 1.0 line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([x + offset for x in range(len(rows))], [r["ratio"][key] for r in rows], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("time / bare cuBLAS GEMM")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=rotation, fontsize=fontsize)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_results(out: Path, env: dict[str, Any], rows: list[dict[str, Any]],
                  markdown: Callable[[list[dict[str, Any]], dict[str, Any], Path], None],
                  plot: Callable[[list[dict[str, Any]], Path], None]) -> None:
    (out / "results.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    markdown(rows, env, out / "results.md")
    plot(rows, out / "results.png")
    print(f"wrote {out}/results.json, results.md, results.png")
