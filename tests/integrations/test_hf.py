"""torch_mhc.hf: converting transformers causal LMs, training, saving and loading them, and
running DeepSeek-V4's hyper-connections on torch-mhc's ops.

Every model is built from a tiny config (hidden 32, 2 layers) with random weights; nothing is
downloaded. Weights are drawn at initializer_range 0.2 (not transformers' 0.02) so that every
branch changes the residual stream substantially and a wrong connection shows in the logits.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_mhc  # noqa: E402
import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON, REL, V  # noqa: E402
from tests.helpers.hf_cases import batch as _batch  # noqa: E402
from tests.helpers.hf_cases import logits as _logits  # noqa: E402
from tests.helpers.hf_cases import perturb_connections as _perturb_connections  # noqa: E402
from tests.helpers.hf_cases import rel as _rel  # noqa: E402
from torch_mhc.integrations.deepseek_v4 import norm_epsilon  # noqa: E402
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import (  # noqa: E402
    IMPLEMENTATION_KEYS,
)
from torch_mhc.runtime.recompute import recompute_streams  # noqa: E402

FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=6)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON,
                                                                            head_dim=8)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def test_importing_torch_mhc_does_not_import_transformers():
    code = "import sys, torch_mhc; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------
# Conversion keeps the function


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_keeps_logits_and_greedy_generation(family):
    model = _model(family)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    prompt, prompt_mask = ids[:2, :8], mask[:2, :8]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    ref_tokens = model.generate(prompt, attention_mask=prompt_mask, **gen)

    assert mhc_hf.convert(model, "mhc", streams=4) is model
    conns = [m for m in model.modules() if isinstance(m, torch_mhc.ManifoldHyperConnection)]
    assert len(conns) == 4 and all(c.streams == 4 for c in conns)
    assert [c.layer_index for c in conns] == [0, 1, 2, 3]
    layer = next(m for m in model.modules() if hasattr(m, "mhc_attn"))
    assert type(layer).__name__ in model._no_split_modules  # device_map keeps it whole
    out = _logits(model, ids, mask)
    print(f"{family} mhc n=4: max |logit diff| / max |logit| = {_rel(out, ref):.1e}")
    assert _rel(out, ref) <= REL, f"{family}: logits differ by {_rel(out, ref):.2e}"
    assert torch.equal(model.generate(prompt, attention_mask=prompt_mask, **gen), ref_tokens)
    with torch_mhc.frozen_connections():  # each prepared call checked at its first token
        assert torch.equal(model.generate(prompt, attention_mask=prompt_mask, **gen),
                           ref_tokens)

    _perturb_connections(model)  # the connections are really in the computation
    assert _rel(_logits(model, ids, mask), ref) > 1e-2


@pytest.mark.parametrize("kind", torch_mhc.CONNECTION_KINDS)
def test_every_connection_kind_keeps_logits(kind):
    model = _model("llama", seed=2)
    ids, mask = _batch(seed=3)
    ref = _logits(model, ids, mask)
    mhc_hf.convert(model, kind, streams=4)
    assert model.config.mhc_conversion["kind"] == kind
    out = _logits(model, ids, mask)
    print(f"llama {kind} n=4: max |logit diff| / max |logit| = {_rel(out, ref):.1e}")
    assert _rel(out, ref) <= REL, f"{kind}: logits differ by {_rel(out, ref):.2e}"


@pytest.mark.parametrize("family", ["mixtral", "gemma", "olmo"])
def test_other_pre_norm_families_are_found_structurally(family):
    """No list of names: any layer whose forward calls norm, attention, norm, MLP converts."""
    build = {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2)),
        "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON,
                                                                             head_dim=8)),
        "olmo": lambda: transformers.OlmoForCausalLM(transformers.OlmoConfig(**COMMON)),
    }[family]
    torch.manual_seed(0)
    model = build().eval()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    mhc_hf.convert(model, "mhc", streams=4)
    assert _rel(_logits(model, ids, mask), ref) <= REL


def test_output_hidden_states_and_attentions_pass_through():
    model = _model("llama")
    model.config._attn_implementation = "eager"  # attention weights are returned by eager
    ids, mask = _batch()
    ref = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    mhc_hf.convert(model, "mhc", streams=2)
    out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2
    for a, b in zip(out.attentions, ref.attentions, strict=True):
        assert _rel(a, b) <= REL
    # hidden states: embeddings [B, T, C]; inner layers' streams [B, T, n, C]; the last
    # layer's output has its streams reduced
    assert out.hidden_states[-1].shape == ref.hidden_states[-1].shape
    assert _rel(out.hidden_states[-1], ref.hidden_states[-1]) <= REL


# ------------------------------------------------------------------------------------------
# Training paths: gradient checkpointing, selective recomputation, compile, bf16


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_same_grads(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert _rel(a[name], b[name]) <= rel, f"{name}: {_rel(a[name], b[name]):.2e}"


def test_gradient_checkpointing_recomputes_and_matches():
    model = mhc_hf.convert(_model("llama").train(), "mhc", streams=4)
    _perturb_connections(model)
    ids, mask = _batch()
    loss, grads = _loss_and_grads(model, ids, mask)
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids, mask)
    assert len(calls) == 2  # forward, then the replay in backward: the layer was checkpointed
    assert torch.equal(loss, loss_ckpt)
    _assert_same_grads(grads_ckpt, grads, 1e-6)
    assert any(".mhc_attn." in n for n in grads)


def test_selective_recomputation_matches():
    model = mhc_hf.convert(_model("qwen3").train(), "mhc", streams=4)
    _perturb_connections(model)
    ids, mask = _batch()
    loss, grads = _loss_and_grads(model, ids, mask)
    with recompute_streams(2) as stats:
        loss_rc, grads_rc = _loss_and_grads(model, ids, mask)
    assert stats.replays > 0
    assert torch.equal(loss, loss_rc)
    _assert_same_grads(grads_rc, grads, 1e-6)


def test_torch_compile_matches_eager():
    model = mhc_hf.convert(_model("gpt2"), "mhc", streams=4)
    _perturb_connections(model)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    compiled = torch.compile(model, backend="aot_eager")
    out = _logits(compiled, ids, mask)
    assert _rel(out, ref) <= 1e-6


def test_bf16_matches_like_the_original():
    """In bf16 the converted model is as close to the fp32 model as the original bf16 model."""
    model = _model("llama")
    ids, mask = _batch()
    truth = _logits(model, ids, mask)
    plain_bf16 = _logits(_model("llama").to(torch.bfloat16), ids, mask)
    mhc_hf.convert(model, "mhc", streams=4)
    model.to(torch.bfloat16)
    out = _logits(model, ids, mask)
    assert out.dtype == torch.bfloat16
    err_plain, err_conv = _rel(plain_bf16, truth), _rel(out, truth)
    assert err_conv <= 2 * err_plain, (err_conv, err_plain)
    model.train()
    loss, grads = _loss_and_grads(model, ids, mask)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())


# ------------------------------------------------------------------------------------------
# Training with transformers.Trainer, connections only, weight decay


class _TextSet(torch.utils.data.Dataset):
    """Byte-level windows of a short repeated sentence: a pattern a tiny model learns fast."""

    def __init__(self, seq_len: int = 16):
        text = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
        ids = torch.tensor(list(text)) % V
        self.windows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def test_trains_with_transformers_trainer(tmp_path):
    pytest.importorskip("accelerate")
    model = mhc_hf.convert(_model("llama"), "mhc", streams=4)
    data = _TextSet()
    optimizer = torch.optim.AdamW(torch_mhc.param_groups(model, weight_decay=0.1), lr=3e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(optimizer, None))
    before = {n: p.detach().clone() for n, p in mhc_hf.connection_parameters(model)}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    moved = [n for n, p in mhc_hf.connection_parameters(model) if not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every connection parameter was trained


def test_trainer_resumes_the_connections(tmp_path):
    """trainer.train(resume_from_checkpoint=...) on a freshly converted model: the Trainer
    loads the checkpoint's model.safetensors into the model, which holds the connections too,
    so they come back as trained (not as the new conversion's initial values), as do the
    base model's weights."""
    pytest.importorskip("accelerate")

    def trainer(model):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
            save_steps=3, learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True,
            seed=0,
        )
        return transformers.Trainer(model=model, args=args, train_dataset=_TextSet())

    model = mhc_hf.convert(_model("llama"), "mhc", streams=4)
    initial = dict(mhc_hf.connection_parameters(mhc_hf.convert(_model("llama"), "mhc", 4)))
    trainer(model).train()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(not torch.equal(p, trained[n]) for n, p in initial.items())  # it trained them
    fresh = mhc_hf.convert(_model("llama"), "mhc", streams=4)
    trainer(fresh).train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    for name, p in fresh.named_parameters():
        assert torch.equal(p, trained[name]), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trainer_default_optimizer_decays_what_param_groups_decays(tmp_path, family):
    """exclude_from_weight_decay: Trainer's own optimizer, built by create_optimizer(), has the
    decay and no-decay groups of torch_mhc.param_groups (the connections' static maps and
    gates and 1-D parameters without decay), for every kind with parameters."""
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1,
                                          report_to=[], use_cpu=True, save_strategy="no")
    for kind in ("hc", "mhc", "mhc-lite"):
        model = mhc_hf.convert(_model(family), kind, streams=4)
        trainer = mhc_hf.exclude_from_weight_decay(transformers.Trainer(model=model, args=args))
        groups = trainer.create_optimizer().param_groups
        decay, no_decay = torch_mhc.param_groups(model, weight_decay=0.1)
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert [{id(p) for p in g["params"]} for g in groups] == [
            {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}]
        exempt = {id(getattr(c, name)) for c in model.modules()
                  if isinstance(c, torch_mhc.Connection) for name in c.no_weight_decay()}
        assert exempt and exempt <= {id(p) for p in groups[1]["params"]}
    with pytest.raises(ValueError, match="already has its optimizer; call it before train"):
        mhc_hf.exclude_from_weight_decay(trainer)
    with pytest.raises(TypeError, match="expects a transformers.Trainer, got Linear"):
        mhc_hf.exclude_from_weight_decay(torch.nn.Linear(2, 2))


def test_train_only_connections():
    model = mhc_hf.convert(_model("gpt2").train(), "mhc", streams=4)
    trainable = mhc_hf.train_only_connections(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".mhc_attn." in n or ".mhc_mlp." in n for n in names)
    assert len(trainable) == len(names) == 2 * 2 * 5  # 2 layers x 2 connections x 5 tensors
    decay, no_decay = torch_mhc.param_groups(model, weight_decay=0.1)
    assert {id(p) for p in decay["params"]} == {
        id(p) for n, p in model.named_parameters() if p.requires_grad and n.endswith(".phi")
    }
    assert len(no_decay["params"]) == 4 * 4  # alpha, b_pre, b_post, b_res: no decay
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([decay, no_decay], lr=1e-2)
    data = _TextSet()
    batch = data.windows[:8]
    losses = []
    for _ in range(15):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


# ------------------------------------------------------------------------------------------
# Saving and loading


def test_save_and_load_exactly(tmp_path):
    model = mhc_hf.convert(_model("qwen2"), "mhc", streams=3, sinkhorn_iters=7)
    _perturb_connections(model)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    out_dir = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    assert (out_dir / "model.safetensors").is_file()
    config = json.loads((out_dir / "config.json").read_text())
    assert {k: config["mhc_conversion"][k] for k in ("kind", "streams", "options")} == {
        "kind": "mhc", "streams": 3, "options": {"sinkhorn_iters": 7}}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left

    loaded = mhc_hf.from_pretrained(out_dir).eval()
    assert type(loaded) is type(model)
    conn = loaded.model.layers[1].mhc_mlp
    assert (conn.streams, conn.sinkhorn_iters, conn.layer_index) == (3, 7, 3)
    assert torch.equal(_logits(loaded, ids, mask), ref)
    # transformers' loading options pass through; the connections follow the dtype
    half = mhc_hf.from_pretrained(out_dir, dtype=torch.bfloat16)
    phi = half.model.layers[0].mhc_attn.phi
    assert phi.dtype == torch.bfloat16
    assert torch.equal(phi, model.model.layers[0].mhc_attn.phi.detach().to(torch.bfloat16))

    # saving again over the same folder replaces it
    _perturb_connections(loaded, seed=9)
    mhc_hf.save_pretrained(loaded, out_dir)
    again = mhc_hf.from_pretrained(out_dir)
    assert torch.equal(_logits(again, ids, mask), _logits(loaded, ids, mask))


def test_failed_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    model = mhc_hf.convert(_model("llama"), "hc", streams=2)
    out_dir = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}

    def broken(self, path, **kwargs):  # transformers' save, failing half-way
        (Path(path) / "config.json").write_text("{half")
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        mhc_hf.save_pretrained(model, out_dir)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


# ------------------------------------------------------------------------------------------
# Bad input


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel.*got Linear"):
        mhc_hf.convert(torch.nn.Linear(4, 4))
    # GPT-NeoX with its parallel residual computes attn and MLP from the same input: not the
    # sequential pre-norm pattern.
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, use_parallel_residual=True))
    e = _refusal(neox)
    assert re.fullmatch(r"torch_mhc.hf cannot convert GPTNeoXForCausalLM: parallel residual: "
                        r"self.attention and self.mlp both read the layer input \(GPTNeoXLayer"
                        r".forward, modeling_gpt_neox.py:\d+\)", str(e)), str(e)
    assert "pre-norm decoder layers" in e.details and "GPTNeoXLayer.forward calls the " \
           "submodules ['input_layernorm', 'attention', 'post_attention_dropout'" in e.details
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    e = _refusal(gemma2)
    assert re.fullmatch(r"torch_mhc.hf cannot convert Gemma2ForCausalLM: sandwich norm: "
                        r"self.self_attn's output is normalised before the residual add "
                        r"\(Gemma2DecoderLayer.forward, modeling_gemma2.py:\d+\)", str(e)), str(e)
    assert "`hidden_states = self.post_attention_layernorm(hidden_states)`) puts something " \
           "else on the residual path" in e.details
    olmo2 = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**COMMON))
    assert "Olmo2ForCausalLM: sandwich norm: self.self_attn's output is normalised before the " \
           "residual add (Olmo2DecoderLayer.forward, modeling_olmo2.py:" in str(_refusal(olmo2))
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON))
    e = _refusal(phi3)  # dropout modules on the residual path
    assert "Phi3ForCausalLM: self.resid_attn_dropout is applied to self.self_attn's output " \
           "before the residual add (Phi3DecoderLayer.forward, modeling_phi3.py:" in str(e)
    assert "Phi3DecoderLayer.forward calls the submodules [" in e.details
    # the line named is the line of the norm call that makes the layer sandwiched
    lines, first = inspect.getsourcelines(type(gemma2.model.layers[0]).forward)
    line = int(str(_refusal(gemma2)).rsplit(":", 1)[1].rstrip(")"))
    assert "self.post_attention_layernorm(" in lines[line - first]


def _refusal(model) -> mhc_hf.ConversionError:
    """convert's refusal of model: one line under 200 characters; the long story in details."""
    with pytest.raises(mhc_hf.ConversionError) as e:
        mhc_hf.convert(model)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 200, msg
    assert len(e.value.details) > 100
    assert not any(".mhc_" in n for n, _ in model.named_parameters())  # left as it was
    return e.value


def test_bad_arguments_and_converting_twice():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"streams must be an int >= 1, got 0"):
        mhc_hf.convert(model, "mhc", streams=0)
    with pytest.raises(ValueError, match="unknown connection kind 'mhcc'"):
        mhc_hf.convert(model, "mhcc")
    with pytest.raises(ValueError, match="must be JSON values"):
        mhc_hf.convert(model, "mhc", branch_scale=torch.ones(1))
    assert not any(".mhc_" in n for n, _ in model.named_parameters())  # nothing half-done
    mhc_hf.convert(model, "mhc", streams=2)
    with pytest.raises(ValueError, match=r"already converted \(\{'kind': 'mhc', 'streams': 2"):
        mhc_hf.convert(model, "hc")
    with pytest.raises(ValueError, match="has no connection parameters"):
        mhc_hf.train_only_connections(_model("gpt2"))
    with pytest.raises(ValueError, match="is not converted"):
        mhc_hf.save_pretrained(_model("gpt2"), "/nonexistent/never")


def _saved(tmp_path) -> Path:
    model = mhc_hf.convert(_model("llama"), "mhc", streams=4)
    return mhc_hf.save_pretrained(model, tmp_path / "ckpt")


def test_checkpoint_without_conversion_record(tmp_path):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["mhc_conversion"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"hold connection parameters .*lacks 'mhc_conversion'"):
        mhc_hf.from_pretrained(path)
    plain = _model("llama")
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="is not a converted checkpoint"):
        mhc_hf.from_pretrained(tmp_path / "plain")
    # loaded as a plain model (its base config taken out by hand, without the attention and
    # experts implementations that refuse the base class), the recorded conversion stops a
    # second, different conversion
    for key in IMPLEMENTATION_KEYS:
        del config["base_config"][key]
    base = transformers.LlamaConfig.from_dict(config["base_config"])
    base.mhc_conversion = {"kind": "mhc", "streams": 4, "options": {}}
    plain = transformers.LlamaForCausalLM.from_pretrained(path, config=base)
    with pytest.raises(ValueError, match="loaded from a converted checkpoint without conversion"):
        mhc_hf.convert(plain, "mhc", streams=4)


def test_checkpoint_with_mismatched_shapes(tmp_path):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["mhc_conversion"]["streams"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.layers.0.mhc_attn.phi has shape \(128, 24\), "
                                         r"the recorded conversion .* expects \(64, 8\)"):
        mhc_hf.from_pretrained(path)
    config["mhc_conversion"].update(streams=4, kind="hc")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"connection weights do not match .*missing "):
        mhc_hf.from_pretrained(path)


# ------------------------------------------------------------------------------------------
# DeepSeek-V4


def _v4_model(seed: int = 0, dtype=torch.float32):
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config = v4.DeepseekV4Config(
        hidden_size=32, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        num_hidden_layers=2, num_attention_heads=2, head_dim=16, q_lora_rank=8, o_lora_rank=8,
        o_groups=1, n_routed_experts=2, num_experts_per_tok=1, index_n_heads=2,
        index_head_dim=8, vocab_size=V, intermediate_size=16, moe_intermediate_size=16,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        experts_implementation="eager",  # grouped_mm has no float64
    )
    torch.manual_seed(seed)
    model = v4.DeepseekV4ForCausalLM(config).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # random maps, not the initial ones
        for m in model.modules():
            if isinstance(m, v4.DeepseekV4HyperConnection):
                m.fn.copy_(0.1 * torch.randn(m.fn.shape, generator=g))
                m.base.copy_(torch.randn(m.base.shape, generator=g))
                m.scale.copy_(0.5 + 1.5 * torch.rand(3, generator=g))
            elif isinstance(m, v4.DeepseekV4HyperHead):
                m.hc_fn.copy_(0.1 * torch.randn(m.hc_fn.shape, generator=g))
                m.hc_base.copy_(torch.randn(m.hc_base.shape, generator=g))
                m.hc_scale.fill_(1.5)
    return model, v4


def _rms_float64(x, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _v4_norm_float64(self, x):
    """DeepseekV4RMSNorm.forward without its float32 round trip."""
    return self.weight * _rms_float64(x, self.variance_epsilon)


def _v4_hc_float64(self, x):
    """DeepseekV4HyperConnection.forward without its float32 casts (for float64 parity)."""
    n = self.hc_mult
    flat = _rms_float64(x.flatten(2), norm_epsilon(self.input_norm))
    pre_w, post_w, comb_w = torch.nn.functional.linear(flat, self.fn).split([n, n, n * n], -1)
    pre_b, post_b, comb_b = self.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
    post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n), -1)
    comb = comb + self.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
    for _ in range(self.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
    return post, comb, (pre.unsqueeze(-1) * x).sum(dim=2)


def _v4_head_float64(self, x):
    flat = _rms_float64(x.flatten(2), norm_epsilon(self.input_norm))
    pre = torch.sigmoid(torch.nn.functional.linear(flat, self.hc_fn) * self.hc_scale
                        + self.hc_base) + self.eps
    return (pre.unsqueeze(-1) * x).sum(dim=2)


def test_deepseek_v4_acceleration_shares_parameters_and_keeps_logits():
    model, v4 = _v4_model()
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits.detach()
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    ref_tokens = model.generate(ids[:, :6], **gen)
    ref_loss = model(ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref_loss, [p for _, p in model.named_parameters()],
                                    allow_unused=True)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())

    assert mhc_hf.accelerate_deepseek_v4(model) is model
    layer = model.model.layers[1]
    assert isinstance(layer.ffn_hc, torch_mhc.ManifoldHyperConnection)
    assert isinstance(model.model.hc_head, torch_mhc.StreamHead)
    assert not any(isinstance(m, (v4.DeepseekV4HyperConnection, v4.DeepseekV4HyperHead))
                   for m in model.modules())
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert list(model.state_dict()) == keys
    assert "MHCDeepseekV4DecoderLayer" in model._no_split_modules  # device_map keeps it whole

    out = model(ids).logits.detach()
    print(f"DeepSeek-V4 fp32: max |logit diff| / max |logit| = {_rel(out, ref):.1e}")
    assert _rel(out, ref) <= REL, f"logits differ by {_rel(out, ref):.2e}"
    assert torch.equal(model.generate(ids[:, :6], **gen), ref_tokens)
    with torch_mhc.frozen_connections():
        assert torch.equal(model.generate(ids[:, :6], **gen), ref_tokens)
    loss = model(ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(after.values()), allow_unused=True)
    for (name, _), g, r in zip(after.items(), grads, ref_grads, strict=True):
        if "hc" in name:  # the hyper-connections' own parameters get the same gradients
            assert g is not None and _rel(g, r) <= 1e-4, name

    with torch_mhc.collect_gains() as gains:
        model(ids)
    report = gains.report()
    assert len(report.layers) == 4  # 2 layers x (attn_hc, ffn_hc)
    for c in report.layer_fwd:  # rows of a Sinkhorn projection sum to 1 (up to hc_eps)
        assert abs(c["max"] - 1) < 1e-4


def test_deepseek_v4_decoding_keeps_its_prepared_calls_and_follows_fn(monkeypatch):
    """Decoding one token at a time prepares each accelerated connection's native calls once
    (phi, a permuted copy of fn, is made once per version of fn, not at every call), equals
    the autograd path, and sees an in-place update of fn and a fused optimizer's step."""
    from torch_mhc.ops.cpu import decode, native

    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    model, _ = _v4_model(seed=5)
    mhc_hf.accelerate_deepseek_v4(model)
    conn = model.model.layers[0].attn_hc
    conn.__dict__["branch"] = lambda h, **kwargs: torch.tanh(h)  # no attention inputs needed
    made = []
    init = decode.Decoder.__init__
    monkeypatch.setattr(decode.Decoder, "__init__",
                        lambda self, *a: made.append(1) or init(self, *a))
    x = torch.randn(2, 1, conn.streams, conn.dim)
    with_grad = conn(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        outs = [conn(x) for _ in range(4)]
    assert len(made) == 1
    assert all(torch.equal(o, with_grad) for o in outs)
    with torch.no_grad():
        conn.fn.mul_(1.5)
        changed = conn(x)
    assert len(made) == 2
    assert (changed - outs[0]).abs().max() > 1e-4
    assert torch.equal(changed, conn(x.clone().requires_grad_()).detach())
    with torch.no_grad():  # a copy made under inference_mode serves later calls too
        conn.fn.mul_(0.5)
    with torch.inference_mode():
        first = conn(x)
    with torch.no_grad():
        later = [conn(x) for _ in range(3)]
    assert len(made) == 3
    assert all(torch.equal(o, first) for o in later)
    conn.fn.grad = torch.randn_like(conn.fn)  # fused AdamW bumps no version of fn
    version = conn.fn._version
    torch.optim.AdamW([conn.fn], lr=0.05, fused=True).step()
    assert conn.fn._version == version
    with torch.no_grad():
        stepped = conn(x)
    assert (stepped - first).abs().max() > 1e-4
    assert torch.equal(stepped, conn(x.clone().requires_grad_()).detach())


def test_deepseek_v4_acceleration_float64(monkeypatch):
    model, v4 = _v4_model(seed=3, dtype=torch.float64)
    monkeypatch.setattr(v4.DeepseekV4HyperConnection, "forward", _v4_hc_float64)
    monkeypatch.setattr(v4.DeepseekV4HyperHead, "forward", _v4_head_float64)
    # the block norms round to float32 too; in float64 everything must stay float64
    monkeypatch.setattr(v4.DeepseekV4RMSNorm, "forward", _v4_norm_float64)
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits.detach()
    assert ref.dtype == torch.float64
    mhc_hf.accelerate_deepseek_v4(model)
    out = model(ids).logits.detach()
    print(f"DeepSeek-V4 float64: max |logit diff| / max |logit| = {_rel(out, ref):.1e}")
    assert _rel(out, ref) <= 1e-12, f"float64 logits differ by {_rel(out, ref):.2e}"


def test_deepseek_v4_trains_on_the_shared_parameters():
    model, _ = _v4_model(seed=4)
    mhc_hf.accelerate_deepseek_v4(model)
    model.train()
    fn = model.model.layers[0].attn_hc.fn
    before = fn.detach().clone()
    opt = torch.optim.AdamW(torch_mhc.param_groups(model, weight_decay=0.1), lr=1e-2)
    decay_ids = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(fn) in decay_ids and id(model.model.layers[0].attn_hc.scale) not in decay_ids
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(2))
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(fn.detach(), before)


def test_deepseek_v4_errors(monkeypatch):
    model, _ = _v4_model()
    # transformers replaces its module object in sys.modules once submodules load
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.8.0")
    with pytest.raises(RuntimeError, match=r"transformers 5.8.0's DeepSeek-V4 .*>= 5.8.1"):
        mhc_hf.accelerate_deepseek_v4(model)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.8.1")
    mhc_hf.accelerate_deepseek_v4(model)
    with pytest.raises(ValueError, match="already accelerated"):
        mhc_hf.accelerate_deepseek_v4(model)
    with pytest.raises(mhc_hf.ConversionError, match="expects a transformers "
                                                     "DeepseekV4ForCausalLM.*got LlamaForCausalLM"):
        mhc_hf.accelerate_deepseek_v4(_model("llama"))


def test_deepseek_v4_accelerated_model_pickles():
    """torch.save of a whole accelerated model: the generated layer class is rebuilt from its
    importable base on load, and the reloaded model gives the same logits."""
    model, _ = _v4_model()
    mhc_hf.accelerate_deepseek_v4(model)
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.model.layers[0]).__name__ == "MHCDeepseekV4DecoderLayer"
    assert torch.equal(loaded(ids).logits, model(ids).logits)
