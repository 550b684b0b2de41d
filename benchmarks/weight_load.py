"""How fast a checkpoint on disk reaches the device: `load_model` against the link's speed.

    python benchmarks/weight_load.py --shape llama3-8b [--folder DIR] [--repeats 2]

Writes a random-weight checkpoint of a `batchgen bench` shape as safetensors shards of about
`--shard-gb` GB (bf16; the tokenizer files come from the embedded model's converted folder,
converted on first use, or from `--tokenizer-from`), then times, each `--repeats` times:

- `load_model`: batchgen's load (read-ahead threads into pinned staging, asynchronous copies,
  the model built around the arriving tensors), to a synchronised device;
- `safetensors load_file`: each shard read by safetensors straight to the device, the plain
  way to load one;
- the ceilings: reading every shard's bytes (4 threads) from the disk, with the page cache
  dropped first where `--drop-caches` can, and again from the page cache; one pinned 1 GiB
  host-to-device copy.

The first `load_model` may find the files outside the page cache if `--drop-caches` could empty
it (root only); otherwise every load reads from the page cache, the case of a rerun or of a
model downloaded moments before. Prints a table of seconds and GB/s.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def write_checkpoint(shape: str, folder: Path, shard_gb: float, tokenizer_from: Path,
                     tiny: bool = False) -> int:
    """A random bf16 checkpoint of `shape` in `folder`; returns its tensor bytes."""
    from safetensors.torch import save_file

    from batchgen.bench_models import checkpoint_specs, hf_config_for, random_checkpoint
    from batchgen.models.loader import meta_model

    hf_config = hf_config_for(shape, tiny)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config.to_json_file(str(folder / "config.json"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    draw_on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    specs = checkpoint_specs(meta_model(hf_config))
    shard, shard_bytes, total, index = {}, 0, 0, 0
    for name, tensor in random_checkpoint(specs, torch.bfloat16, draw_on):
        shard[name] = tensor.cpu()
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= shard_gb * 1e9:
            save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
            total, shard, shard_bytes, index = total + shard_bytes, {}, 0, index + 1
    if shard:
        save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
        total += shard_bytes
    return total


def drop_page_cache(folder: Path) -> bool:
    """Empty the page cache (root only); False where it cannot."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_all(folder: Path) -> float:
    """Seconds to read every shard's bytes (4 threads, 64 MiB reads)."""
    def read(path: Path) -> None:
        with path.open("rb", buffering=0) as f:
            buf = bytearray(64 << 20)
            while f.readinto(buf):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(read, sorted(folder.glob("*.safetensors"))))
    return time.perf_counter() - start


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def batchgen_load(folder: Path, device: torch.device) -> None:
    from batchgen.config import ModelConfig
    from batchgen.models.factory import load_model

    loaded = load_model(ModelConfig(model=str(folder)), device)
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()


def safetensors_load(folder: Path, device: torch.device) -> None:
    from safetensors.torch import load_file

    tensors = [load_file(str(path), device=str(device))
               for path in sorted(folder.glob("*.safetensors"))]
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pinned_copy_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    seconds = timed(lambda: dst.copy_(src, non_blocking=True), device)
    return src.numel() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b", help="a `batchgen bench --shape`")
    parser.add_argument("--folder", type=Path, help="where to write it (default: a temp dir)")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokenizer-from", type=Path,
                        help="a model folder whose tokenizer files to copy (default: the "
                             "embedded model's converted folder)")
    parser.add_argument("--tiny", action="store_true", help="the shape at toy widths (a smoke run)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="empty the page cache before the first load (root only)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="batchgen-weights-"))
    tokenizer_from = args.tokenizer_from
    if tokenizer_from is None:
        from batchgen.models.convert import converted_for_gguf, embedded_gguf

        tokenizer_from = converted_for_gguf(embedded_gguf(), None)
    total = write_checkpoint(args.shape, folder, args.shard_gb, tokenizer_from, args.tiny)
    print(f"{args.shape}: {total / 1e9:.2f} GB of bf16 tensors in {folder}")
    rows = []
    for repeat in range(args.repeats):
        note = ""
        if repeat == 0 and args.drop_caches:
            note = " (page cache dropped)" if drop_page_cache(folder) else " (could not drop)"
        rows.append((f"load_model #{repeat + 1}{note}", timed(
            lambda: batchgen_load(folder, device), device)))
    for repeat in range(args.repeats):
        rows.append((f"safetensors load_file #{repeat + 1}", timed(
            lambda: safetensors_load(folder, device), device)))
    if args.drop_caches and drop_page_cache(folder):
        rows.append(("read from the disk (page cache dropped)", read_all(folder)))
    rows.append(("read from the page cache", read_all(folder)))
    print(f"{'what':40s} {'seconds':>8s} {'GB/s':>7s}")
    for what, seconds in rows:
        print(f"{what:40s} {seconds:8.2f} {total / seconds / 1e9:7.1f}")
    link = pinned_copy_gbps(device)
    if link is not None:
        print(f"{'one pinned 1 GiB host -> device copy':40s} {'':8s} {link:7.1f}")
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
