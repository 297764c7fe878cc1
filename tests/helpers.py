"""Shared test helpers (importable as `from helpers import ...`; conftest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch


def nano_cut(layers: int = 4):
    """The nano preset cut to its first `layers` layers through the trainer's override path (so the layer lists
    that depend on the count follow). 4 layers: 3 KDA + 1 MLA, a dense FFN then MoE, two AttnRes blocks: every
    layer kind at under half of nano's cost."""
    from openk3.train.config import TrainConfig, apply_overrides

    return apply_overrides(TrainConfig(), [f"model.num_hidden_layers={layers}"]).model


def rel_rms_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """||got - ref||_rms / ||ref||_rms in float64 (0 when both are exactly zero)."""
    ref64, got64 = ref.detach().double(), got.detach().double()
    err = (got64 - ref64).pow(2).mean().sqrt().item()
    base = ref64.pow(2).mean().sqrt().item()
    if base == 0.0:
        return err
    return err / base


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    """Assert `got` matches `ref` to a relative RMS error <= `ratio` (FLA's `assert_close` idea).

    Shapes must match exactly and `got` must be finite wherever `ref` is, so a NaN from an
    uninitialised buffer or an overflow fails loudly instead of being averaged away.
    """
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    bad = (~torch.isfinite(got) & finite).sum().item()
    assert bad == 0, f"{name}: {bad} non-finite values where the reference is finite"
    err = rel_rms_error(ref[finite], got[finite])
    abs_max = (ref[finite].double() - got[finite].double()).abs().max().item() if finite.any() else 0.0
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs diff {abs_max:.3e})"


#: torch's inductor (2.13) writes `at::vec` code that its own header leaves out when ATEN_CPU_CAPABILITY=default
#: (the level of an x86-64 CPU without AVX2; `scripts/test.sh --isa default` sets it): the C++ build of some graphs
#: fails, and openk3's DecodeGraph then decodes eagerly with a warning. Tests that assert a compiled graph skip there.
needs_vector_inductor = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") == "default",
    reason="torch's inductor cannot build vectorized C++ with ATEN_CPU_CAPABILITY=default (a torch bug; "
           "openk3 decodes eagerly there)")


def perturb(model, seed: int = 1):
    """`model` (float64) with random AttnRes pseudo-queries, norm gains, KDA decay logs and router biases, in
    place: at init the queries are zero (uniform mixing) and the gains one, which would hide a wrong candidate
    order or a missing gain."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=torch.float64))
    return model


class Killed(Exception):
    """What a test raises from a hook (`on_event`, `on_step`, a patched write) to stand for the process being
    killed there: nothing after that point runs, and the next run must resume as if it never happened."""


@contextlib.contextmanager
def torn_write_at(monkeypatch, step: int):
    """While active, the checkpoint of `step` dies inside its write: half a trainer_state.pt in the temp folder,
    then `Killed` (what a SIGKILL there leaves, less the cleanup the exception path does)."""
    from openk3.checkpoint import steps

    real = steps.write_trainer_state

    def torn(path, state):
        if state["step"] == step:
            path.write_bytes(b"half a trainer state")
            raise Killed
        real(path, state)

    monkeypatch.setattr(steps, "write_trainer_state", torn)
    try:
        yield
    finally:
        monkeypatch.setattr(steps, "write_trainer_state", real)


class ScriptedEngine:
    """The `Engine` surface a rollout uses (add_request / step / abort / has_unfinished), emitting scripted turns
    one token per step with log-prob -1 each (and two top entries when the request asks for log-probs).
    `script(prompt ids, request id) -> ids` decides each request's turn; it ends at a stop id, the end of the
    script or max_tokens. Keeps the sampling params it saw and the request ids it was asked to abort."""

    def __init__(self, script, *, vocab_size: int = 512, max_model_len: int = 1 << 20):
        self.script, self.max_model_len = script, max_model_len
        self.cfg = type("Cfg", (), {"vocab_size": vocab_size})
        self.reqs: dict[str, list] = {}
        self.params: list = []
        self.aborted: list[str] = []

    def add_request(self, prompt, params, *, request_id, stop_token_ids=(), ignore_eos=False):
        self.params.append(params)
        self.reqs[request_id] = [list(prompt), list(self.script(list(prompt), request_id)), 0,
                                 frozenset(stop_token_ids), params.max_tokens, bool(params.logprobs)]
        return request_id

    def abort(self, rid):
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def has_unfinished(self):
        return bool(self.reqs)

    def step(self):
        from openk3.infer.engine import RequestOutput

        outs = []
        for rid, req in list(self.reqs.items()):
            prompt, toks, k, stops, max_tokens, top = req
            tok = toks[k]
            req[2] = k = k + 1
            done = tok in stops or k == len(toks) or k == max_tokens
            outs.append(RequestOutput(rid, prompt, toks[:k], "", [tok], "", done,
                                      "stop" if tok in stops else "length" if done else None, logprobs=None,
                                      delta_logprobs=[(-1.0, [(tok, -1.0), (tok ^ 1, -2.0)] if top else [])]))
            if done:
                del self.reqs[rid]
        return outs


def assistant_ids(tok, prompt_messages: list[dict], message: dict, effort: str, tools: list | None = None) -> list[int]:
    """The ids a model generates for `message` after the generation prompt of `prompt_messages` (rendered with
    `tok`): what a scripted engine must emit for that turn."""
    from openk3.chat import encode_segments, render

    def ids(messages, prompt):
        return encode_segments(render({"messages": messages, "tools": tools or [], "thinking_effort": effort,
                                       "add_generation_prompt": prompt}), tok).ids

    before, after = ids(prompt_messages, True), ids([*prompt_messages, message], False)
    assert after[:len(before)] == before
    return after[len(before):]
