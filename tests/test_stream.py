"""Routed experts streamed from a release-format checkpoint (`openk3/stream/`): bit for bit the in-memory packed
model (logits and greedy tokens) across cache sizes, I/O threads, direct and buffered reads, shard layouts and
engine batches; faults name the file and the offset; the cache keeps per-layer LRU sets whose quotas follow
the hits."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from test_llm import byte_tokenizer

import openk3
from openk3.checkpoint import load
from openk3.infer.llm import LLM
from openk3.stream import ExpertReadError, parse_bytes
from openk3.stream.index import ALIGN, ExpertIndex, shard_header

needs_kernel = pytest.mark.skipif(not __import__("openk3.ops.moe_mxfp4_cpu", fromlist=["x"]).available(),
                                  reason="needs the MXFP4 CPU kernel (a C compiler)")


def _nano_cfg():
    cfg = openk3.preset("nano")
    return cfg


def release_order(folder) -> None:
    """Rewrite every shard with the `safetensors` library's own writer (tensors ordered by dtype, then name:
    `experts.0, .1, .10, ...`, each expert's six tensors back to back `w1p w1s w2p w2s w3p w3s`), as the release
    was written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(str(folder / f), "pt") as h:
                tensors = {k: h.get_tensor(k) for k in h.keys()}
                meta = h.metadata()
            save_file(tensors, str(folder / f), metadata=meta)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"openk3": written by openk3.save, "release": the same rewritten in the release's tensor order}, nano,
    MXFP4 experts, float32 trunk, with a tokenizer; small shards so layers span files."""
    root = tmp_path_factory.mktemp("stream")
    model = openk3.K3ForCausalLM.build(_nano_cfg(), seed=0)
    out = {}
    for kind in ("openk3", "release"):
        path = root / kind
        openk3.save(model, path, experts_format="mxfp4", dtype=torch.float32, max_shard_bytes=300_000)
        byte_tokenizer().save(str(path))
        if kind == "release":
            release_order(path)
        out[kind] = path
    return out


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids)


def _slot(path) -> int:
    inv, _ = load.__globals__["inventory"](path)
    return ExpertIndex.from_inventory(inv).slot_bytes


@needs_kernel
def test_release_layout_is_one_read_per_expert(ckpts):
    """In the safetensors library's order each expert is one contiguous run (one read); every expert's tensors are
    where the headers say."""
    inv, _ = load.__globals__["inventory"](ckpts["release"])
    idx = ExpertIndex.from_inventory(inv)
    one_file = [(layer, e) for layer in idx.layers for e in range(idx.num_experts)
                if len({x.file for x in idx.loc(layer, e).extents}) == 1]
    assert len(one_file) > 0.9 * len(idx.layers) * idx.num_experts  # the rest straddle a shard boundary
    assert all(len(idx.loc(*le).extents) == 1 for le in one_file)
    C, I = idx.dim, idx.hidden
    assert idx.expert_bytes == 3 * I * C // 2 + 3 * I * C // 32
    assert all(0 <= d < ALIGN for d in idx.pads())
    assert len(idx.files()) > 1  # the layers span several shards


@needs_kernel
@pytest.mark.parametrize("layout", ["openk3", "release"])
@pytest.mark.parametrize("slots_per_layer,threads,direct", [(1, 1, None), (5, 3, False), (40, 2, None)])
def test_streamed_logits_are_bitwise_the_packed_model(ckpts, layout, slots_per_layer, threads, direct):
    """Prefill of two rows (the MXFP4 kernel) at the minimum cache (one expert per layer), below the working set
    and with every expert cached, 1-3 I/O threads, direct and buffered: logits equal keep_packed's exactly;
    the counters add up."""
    path = ckpts[layout]
    ref = load(path, keep_packed=True)
    slot = _slot(path)
    n_moe = sum(1 for m in ref.modules() if type(m).__name__ == "SparseMoE")
    model = load(path, experts="stream", expert_cache=slots_per_layer * n_moe * slot, io_threads=threads,
                 direct_io=direct)
    ids = torch.randint(0, ref.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    first = openk3.stream.stats(model)["reads"]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    st = openk3.stream.stats(model)
    assert st["requests"] == st["hits"] + st["reads"] and st["reads"] > 0
    assert st["hit_rate"] == pytest.approx(1 - st["reads"] / st["requests"])
    assert st["bytes_read"] >= st["reads"] * model.expert_stream.index.expert_bytes
    if slots_per_layer == 40:  # everything fits: the second pass reads nothing
        assert st["reads"] == first <= n_moe * ref.config.num_experts
    if direct is False:
        assert not st["direct_io"]


@needs_kernel
def test_streamed_bf16_trunk_dequantises_per_expert_bitwise(ckpts):
    """A bf16 trunk takes the per-expert dequantise path (experts_packed) in windows of the layer's quota: equal."""
    path = ckpts["release"]
    ref = load(path, dtype=torch.bfloat16, keep_packed=True)
    n_moe = sum(1 for m in ref.modules() if type(m).__name__ == "SparseMoE")
    model = load(path, dtype=torch.bfloat16, experts="stream", expert_cache=3 * n_moe * _slot(path))
    ids = torch.randint(0, ref.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


@needs_kernel
def test_streamed_engine_batches_equal_packed_greedy_tokens(ckpts):
    """Greedy generation through the engine with sequences joining (max_num_seqs 2 of 4 prompts) and leaving
    (different lengths): the same tokens as keep_packed, at a cache below the working set."""
    path = ckpts["release"]
    prompts = ["Hello", "The quick brown fox", "a", "Streaming experts from disk"]
    kw = {"max_tokens": 7, "temperature": 0, "ignore_eos": True}
    ref = LLM(path, keep_packed=True, max_num_seqs=2)
    want = [o.token_ids for o in ref.generate(prompts, **kw)]
    n_moe = sum(1 for m in ref.model.modules() if type(m).__name__ == "SparseMoE")
    llm = LLM(path, experts="stream", expert_cache=6 * n_moe * _slot(path), io_threads=2, max_num_seqs=2)
    got = [o.token_ids for o in llm.generate(prompts, **kw)]
    assert got == want
    with pytest.raises(ValueError, match="uncompiled"):
        LLM(path, experts="stream", compile=True)


def test_parse_bytes():
    assert parse_bytes("22GB") == 22 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes(4096) == 4096
    assert parse_bytes("500 MB") == 500 * 10**6
    for bad in ("lots", "-1GB", "0", "12XB"):
        with pytest.raises(ValueError, match="expert_cache"):
            parse_bytes(bad, "expert_cache")


@needs_kernel
def test_stream_refusals(ckpts, tmp_path):
    path = ckpts["release"]
    with pytest.raises(ValueError, match="at least one per MoE layer"):
        load(path, experts="stream", expert_cache="10KB")
    with pytest.raises(ValueError, match="'memory' or 'stream'"):
        load(path, experts="disk")
    with pytest.raises(ValueError, match="device must be cpu"):
        load(path, experts="stream", device="cuda")
    plain = tmp_path / "bf16"
    openk3.save(openk3.K3ForCausalLM.build(_nano_cfg(), seed=0), plain, dtype=torch.float32)
    with pytest.raises(ValueError, match="need MXFP4 experts"):
        load(plain, experts="stream")


# ---- faults ------------------------------------------------------------------------------------------------


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _expert_file_offset(path, layer=1, expert=0, k=0):
    inv, _ = load.__globals__["inventory"](path)
    loc = ExpertIndex.from_inventory(inv).loc(layer, expert)
    x = loc.extents[0]
    return path / x.file, x.offset + (loc.tensor_offsets[k] - x.region - x.pad)


def _forward_all_experts(model):
    """A forward whose routing touches many experts of every layer."""
    ids = torch.arange(0, 64).reshape(2, 32) % model.config.vocab_size
    return _logits(model, ids)


@needs_kernel
@pytest.mark.parametrize("fault", ["short", "eio"])
def test_read_faults_name_file_and_offset(ckpts, fault):
    model = load(ckpts["release"], experts="stream", expert_cache="1MB", io_threads=2)
    reader = model.expert_stream.reader
    real = reader.pread
    calls = []

    def pread(fd, bufs, pos):
        if fault == "eio":
            raise OSError(5, "Input/output error")
        calls.append(pos)
        return min(real(fd, bufs, pos), ALIGN) if len(calls) == 1 else 0  # one block, then the file "ends"

    reader.pread = pread
    pattern = "short read at offset" if fault == "short" else "Input/output error"
    with pytest.raises(ExpertReadError, match=r"model-\d+-of-\d+\.safetensors: .*offset \d+") as info:
        _forward_all_experts(model)
    assert pattern in str(info.value)
    reader.pread = real  # the cache is still sound after the failure: a clean pass equals the packed model
    ref = load(ckpts["release"], keep_packed=True)
    assert torch.equal(_forward_all_experts(model), _forward_all_experts(ref))


@needs_kernel
def test_truncated_shard_after_load_is_a_short_read(ckpts, tmp_path):
    path = _copy(ckpts["release"], tmp_path / "c")
    model = load(path, experts="stream", expert_cache="1MB", direct_io=False)
    file, off = _expert_file_offset(path, layer=max(model.expert_stream.index.layers), expert=0)
    os.truncate(file, off + 100)
    with pytest.raises(ExpertReadError, match=f"{file.name}: short read at offset"):
        _forward_all_experts(model)


@needs_kernel
def test_truncated_shard_or_bad_offsets_fail_at_load(ckpts, tmp_path):
    path = _copy(ckpts["release"], tmp_path / "c")
    file, off = _expert_file_offset(path)
    os.truncate(file, off + 100)
    with pytest.raises(ValueError, match=file.name):
        load(path, experts="stream")
    # a header whose offsets point past the end of the file (the index points outside it)
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"t": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 10)
    with pytest.raises(ValueError, match="bad.safetensors: tensor t points outside the file"):
        shard_header(bad)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_byte_255_names_file_and_offset(ckpts, tmp_path, dtype):
    """An E8M0 NaN scale in a streamed expert: refused as its read lands, naming the file and the byte's offset,
    whatever path would compute it; never NaN logits."""
    path = _copy(ckpts["release"], tmp_path / "c")
    file, off = _expert_file_offset(path, layer=1, expert=3, k=1)  # expert 3's gate scales
    with open(file, "r+b") as fh:
        fh.seek(off + 5)
        fh.write(b"\xff")
    model = load(path, dtype=dtype, experts="stream", expert_cache="2MB")
    with pytest.raises(ValueError, match=rf"{file.name}: MXFP4 scale byte 255 .* at offset {off + 5} "
                                         rf"\(layer 1, expert 3\)"):
        _forward_all_experts(model)


# ---- the cache -----------------------------------------------------------------------------------------------


class _FakeIndex:
    def __init__(self, layers, E=64, slot=ALIGN):
        self.layers, self.num_experts, self.slot_bytes = layers, E, slot
        self.dim = self.hidden = 32
        self.tensor_offsets = {k: torch.zeros(E, 6, dtype=torch.int64) for k in layers}

    def loc(self, layer, e):
        class L:
            extents = ()
            first_offset = ("f", e)
        return L()


class _NoReader:
    threads, bytes_read, read_seconds, direct_files, buffered_files = 1, 0, 0.0, [], []

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f = Future()
        f.set_result(None)
        return f

    def close(self):
        pass


def _call(cache, layer, experts):
    q = cache.quota(layer)
    for i in range(0, len(experts), q):
        window = experts[i:i + q]
        cache.acquire(layer, window)
        for e in window:
            cache.wait(layer, e)
        cache.release(layer, window)


def test_per_layer_lru_and_quotas_follow_hits():
    """Layer 1 cycles through 6 experts (an LRU of 4 never hits; 6 slots always would), layer 2 asks random ones
    of 64 (no reuse): quotas move to layer 1 until its cycle fits, and its hits follow."""
    from openk3.stream.cache import ExpertCache

    cache = ExpertCache(_FakeIndex([1, 2]), _NoReader(), 8 * ALIGN, rebalance_every=4)
    assert cache.stats()["quotas"] == {1: 4, 2: 4}
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        _call(cache, 1, [step % 6])
        _call(cache, 2, sorted(set(torch.randint(0, 64, (2,), generator=gen).tolist())))
    q = cache.stats()["quotas"]
    assert q[1] >= 6 and q[1] + q[2] == 8
    before = cache.layers[1].stats.hits
    for step in range(12):
        _call(cache, 1, [step % 6])
    assert cache.layers[1].stats.hits - before == 12
    # a pinned expert is never evicted while other windows come and go through the layer's other slots
    L2 = cache.layers[2]
    cache.acquire(2, [63])
    for step in range(20):
        _call(cache, 2, sorted({step % 40, (step * 7) % 40})[:L2.quota - 1])
        assert 63 in L2.resident
    cache.release(2, [63])


# ---- the command line and the server ----------------------------------------------------------------------


@needs_kernel
def test_generate_cli_streams_with_stats(ckpts, capsys):
    """`openk3 generate --experts stream --expert-cache SIZE --stats`: the tokens of --keep-packed, and the
    counters on stderr; stream flags without --experts stream are refused."""
    from openk3.__main__ import main

    path = str(ckpts["release"])
    argv = ["generate", "--model", path, "--prompt", "Hello", "--max-tokens", "5", "--temperature", "0",
            "--ignore-eos", "--json"]
    assert main(argv + ["--keep-packed"]) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(argv + ["--experts", "stream", "--expert-cache", "1MB", "--io", "buffered", "--stats"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == want
    assert "[experts]" in out.err and "hit rate" in out.err and "buffered I/O" in out.err
    assert main(argv + ["--expert-cache", "1MB"]) == 2
    assert "--expert-cache and --io apply to --experts stream" in capsys.readouterr().err


@needs_kernel
@pytest.mark.parametrize("in_thread", [True, False], ids=["engine-thread", "engine-process"])
def test_server_metrics_show_the_expert_cache(ckpts, in_thread):
    """/metrics carries the expert cache's counters, from an engine thread and from the engine's own process."""
    import functools

    import httpx
    from openai import OpenAI
    from serve_helpers import served

    from openk3.serve import create_app

    build = functools.partial(LLM, str(ckpts["release"]), experts="stream", expert_cache="1MB")
    app = create_app(build, served_model_name="nano-stream", engine_in_thread=in_thread)
    with served(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="nano-stream", prompt="Hi", max_tokens=3, temperature=0)
        assert r.choices[0].text is not None
        text = httpx.get(url + "/metrics").text
    reads = [line for line in text.splitlines() if line.startswith("openk3:expert_reads_total")]
    assert reads and float(reads[0].split()[-1]) > 0
    assert 'openk3:expert_cache_hit_rate{model_name="nano-stream"}' in text


@needs_kernel
def test_streamed_float32_dequantise_path_is_bitwise(ckpts, monkeypatch):
    """Forced onto the per-expert dequantise path (what float32 prefill takes above MXFP4_KERNEL_MAX_PAIRS), at a
    cache of two experts per layer: still the packed model's logits."""
    from openk3.model import moe as moe_mod

    monkeypatch.setattr(moe_mod, "MXFP4_KERNEL_MAX_PAIRS", 0)
    path = ckpts["openk3"]
    ref = load(path, keep_packed=True)
    n_moe = sum(1 for m in ref.modules() if type(m).__name__ == "SparseMoE")
    model = load(path, experts="stream", expert_cache=2 * n_moe * _slot(path))
    ids = torch.randint(0, ref.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


# ---- the synthetic release and the planner ----------------------------------------------------------------

def _synth_module():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("synth_release", root / "scripts" / "synth_release.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_kernel
def test_synth_release_tiny_streams_and_generates(tmp_path, capsys):
    """scripts/synth_release.py --tiny: a kimi_k3 wrapper checkpoint (language_model. names, MXFP4 experts, the
    safetensors library's order, no holes) that streams bit for bit as keep_packed and runs `openk3 generate
    --experts stream`; full-width configs keep K3's widths."""
    from openk3.__main__ import main

    synth = _synth_module()
    out = tmp_path / "syn"
    assert synth.main([str(out), "--tiny", "--layers", "3"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["moe_layers"] == 2 and summary["shards"] > 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "quantization_config" in cfg["text_config"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all(k.startswith("language_model.") for k in index["weight_map"])
    for f in out.glob("*.safetensors"):
        st = os.stat(f)
        assert st.st_blocks * 512 >= st.st_size - 4096  # written, not sparse
    ref = load(out, keep_packed=True, dtype=torch.float32)
    model = load(out, experts="stream", expert_cache="1MB", dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert main(["generate", "--model", str(out), "--prompt", "Hi", "--max-tokens", "3", "--temperature", "0",
                 "--experts", "stream", "--expert-cache", "1MB", "--stats"]) == 0
    assert "[experts]" in capsys.readouterr().err
    big = synth.synth_config(3, 8192, tiny=False)
    assert (big.hidden_size, big.num_experts, big.expert_in_dim, big.moe_intermediate_size) == (7168, 896, 3584, 3072)
    assert big.vocab_size == 8192 and big.eos_token_id < 8192 and big.num_hidden_layers == 3
    with pytest.raises(ValueError, match="--layers"):
        synth.synth_config(1, 8192, tiny=False)


def test_disk_planner_k3_arithmetic(capsys):
    """K3 from disk: 1,472 expert reads of 17,547,264 bytes per cold token (25.83 GB, 3.69 s at 7 GB/s); an int4
    trunk of ~31-33 GB fits 64 GB and not 32 GB; the hit-rate curve runs 0 -> 1; the CLI prints it."""
    from openk3.__main__ import main
    from openk3.plan import models
    from openk3.plan.stream import DiskSpec, expert_bytes_per_token, k3_hit_rate, plan_disk

    cfg, _ = models.resolve("k3", None, None)
    cold = plan_disk(cfg, DiskSpec(hit_rate=0.0))
    assert cold["decode"]["expert_bytes_each"] == 17_547_264
    assert cold["decode"]["disk_bytes_per_token"] == 1472 * 17_547_264 == expert_bytes_per_token(92, 16, 17_547_264, 0)
    assert cold["decode"]["disk_s_per_token"] == pytest.approx(25.8296 / 7, rel=1e-4)
    # as openk3 holds it: int4 codes + float32 scale and zero per 32 (0.75 B) for 52.6 B weights, 2.1 B weights
    # never quantised in float32 (embedding, routers, kv_b_proj, vectors), lm_head int8
    mem = cold["memory"]
    assert 52e9 < mem["quantised_params"] < 53.5e9 and 2.0e9 < mem["float_params"] < 2.3e9
    assert mem["trunk_bytes"] == pytest.approx(0.75 * mem["quantised_params"] + 4 * mem["float_params"] + 163840 * 7168)
    assert mem["fits"] and not plan_disk(cfg, DiskSpec(ram_bytes=48e9))["memory"]["fits"]
    g128 = plan_disk(cfg, DiskSpec(trunk_group=128))["memory"]["trunk_bytes"]
    assert g128 == pytest.approx(mem["trunk_bytes"] - (0.75 - 0.5625) * mem["quantised_params"])
    warm = plan_disk(cfg, DiskSpec(hit_rate=0.3))
    assert warm["decode"]["disk_bytes_per_token"] == pytest.approx(0.7 * cold["decode"]["disk_bytes_per_token"])
    assert k3_hit_rate(0, 896) == 0 and k3_hit_rate(896, 896) == 1 and k3_hit_rate(26, 896) == pytest.approx(0.30)
    curve = [k3_hit_rate(s, 896) for s in range(0, 900, 7)]
    assert curve == sorted(curve)
    prefill = cold["prefill"]
    assert prefill["distinct_experts_per_layer"] > 890  # a 4K chunk touches nearly every expert
    assert main(["plan", "--experts-on", "disk", "--disk-gbps", "7", "--ram", "64GB", "--hit-rate", "0"]) == 0
    assert "25.83 GB read per token" in capsys.readouterr().out
    with pytest.raises(ValueError, match="hit_rate"):
        plan_disk(cfg, DiskSpec(hit_rate=1.5))


@needs_kernel
def test_interrupt_while_a_read_is_in_flight_keeps_its_slot(ckpts):
    """Ctrl-C while the engine waits on a read (chat catches it and goes on): the read stays in flight in its slot,
    which no other expert may take until it lands; afterwards the model still equals the packed one."""
    import threading

    model = load(ckpts["release"], experts="stream", expert_cache="1MB", io_threads=2)
    cache = model.expert_stream
    layer = cache.index.layers[0]
    gate = threading.Event()
    real = cache.reader.pread

    def slow(fd, bufs, pos):
        gate.wait(10)
        return real(fd, bufs, pos)

    cache.reader.pread = slow
    cache.acquire(layer, [0])
    fut = cache.layers[layer].loading[0]
    slot = cache.layers[layer].resident[0]

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    fut.result = interrupted
    with pytest.raises(KeyboardInterrupt):
        cache.wait(layer, 0)
    del fut.result
    L = cache.layers[layer]
    assert 0 in L.loading and slot not in L.free
    cache.release(layer, [0])
    # a full window of other experts needs expert 0's slot: it is handed over only once that read has landed
    others = list(range(1, L.quota + 1))
    landed = []
    timer = threading.Timer(0.3, lambda: (landed.append(True), gate.set()))
    timer.start()
    cache.acquire(layer, others)
    assert landed and 0 not in L.resident and slot in L.resident.values()
    for e in others:
        cache.wait(layer, e)
    cache.release(layer, others)
    cache.reader.pread = real
    ref = load(ckpts["release"], keep_packed=True)
    assert torch.equal(_forward_all_experts(model), _forward_all_experts(ref))


@needs_kernel
def test_scale_bytes_too_large_for_the_dtype_are_refused_as_keep_packed_does(ckpts, tmp_path):
    """A scale byte whose weights overflow the compute dtype (200: 2^73 x 6 is inf in float16): keep_packed refuses
    the load, streaming refuses the read, naming file and offset; float32 takes it in both."""
    path = _copy(ckpts["release"], tmp_path / "c")
    file, off = _expert_file_offset(path, layer=1, expert=3, k=1)
    with open(file, "r+b") as fh:
        fh.seek(off)
        fh.write(bytes([200]))
    with pytest.raises(ValueError, match="too large"):
        load(path, dtype=torch.float16, keep_packed=True)
    model = load(path, dtype=torch.float16, experts="stream", expert_cache="2MB")
    with pytest.raises(ValueError, match=rf"{file.name}: MXFP4 scale byte 200 .*too large.* at offset {off} "):
        _forward_all_experts(model)
    assert torch.isfinite(_forward_all_experts(load(path, experts="stream", expert_cache="2MB"))).all()


@needs_kernel
def test_direct_reads_are_used_where_the_filesystem_takes_them(ckpts):
    from openk3.stream.io import _open

    fd, direct = _open(next(ckpts["release"].glob("*.safetensors")), None)
    os.close(fd)
    if not direct:
        with pytest.raises(ValueError, match="O_DIRECT"):
            load(ckpts["release"], experts="stream", direct_io=True)
        pytest.skip("this filesystem refuses O_DIRECT (buffered reads are tested elsewhere)")
    model = load(ckpts["release"], experts="stream", expert_cache="1MB", direct_io=True)
    ref = load(ckpts["release"], keep_packed=True)
    assert torch.equal(_forward_all_experts(model), _forward_all_experts(ref))
    assert openk3.stream.stats(model)["direct_io"]


def test_streamed_and_integer_models_refuse_to_save(ckpts, tmp_path):
    with pytest.raises(ValueError, match="save the checkpoint it was loaded from"):
        openk3.save(load(ckpts["release"], experts="stream", expert_cache="1MB"), tmp_path / "x")
    with pytest.raises(ValueError, match="integer trunk"):
        openk3.save(load(ckpts["release"], trunk="int8"), tmp_path / "y")
