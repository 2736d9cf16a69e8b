"""torch_mhc.hf with PEFT: LoRA on the attention projections and trainable connections.

The recipe (docs/huggingface.md): LoraConfig(target_modules=[...], modules_to_save=["mhc_attn",
"mhc_mlp"]). PEFT deep-copies each connection named in modules_to_save and trains the copy; the
copy must keep calling the model's own layer, whose projections carry the LoRA weights.
Models are built from a tiny Llama config with random weights; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON  # noqa: E402
from tests.helpers.hf_cases import batch as _batch  # noqa: E402
from tests.helpers.hf_cases import logits as _logits  # noqa: E402
from tests.helpers.hf_cases import rel as _rel  # noqa: E402


def _converted(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    return mhc_hf.convert(model, "mhc", streams=4)


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           modules_to_save=["mhc_attn", "mhc_mlp"])


def _train(model, ids, mask, steps: int = 4) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        # LoRA's A gets no gradient in the first step (B starts at zero), but it gets one
        assert all(p.grad is not None for p in params)
        opt.step()
        losses.append(loss.item())
    assert all(p.grad.abs().sum() > 0 for p in params)  # the last step reached every one
    return losses


def test_lora_with_trainable_connections_trains_saves_and_reloads(tmp_path):
    ids, mask = _batch()
    base_logits = _logits(_converted(), ids, mask)
    model = peft.get_peft_model(_converted(), _lora_config())
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    lora = [n for n in trainable if ".lora_" in n]
    conns = [n for n in trainable if ".mhc_attn." in n or ".mhc_mlp." in n]
    assert len(lora) == 2 * 3 * 2  # 2 layers x 3 projections x (A, B)
    assert len(conns) == 2 * 2 * 5  # 2 layers x 2 connections x (phi, alpha, b_pre, b_post, b_res)
    assert len(lora) + len(conns) == len(trainable)

    model.train()
    losses = _train(model, ids, mask)  # every trainable parameter gets a gradient
    assert losses[-1] < losses[0], losses
    moved = {n for n, p in model.named_parameters() if p.requires_grad
             and not torch.equal(p, trainable[n])}
    assert moved == set(trainable)  # both the LoRA weights and the connections trained

    model.eval()
    tuned = _logits(model, ids, mask)
    with model.disable_adapter():  # the base layers and the original connections
        assert torch.equal(_logits(model, ids, mask), base_logits)
    assert _rel(tuned, base_logits) > 1e-2

    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sum(".mhc_attn." in k or ".mhc_mlp." in k for k in saved) == len(conns)
    reloaded = peft.PeftModel.from_pretrained(_converted(), tmp_path).eval()
    assert torch.equal(_logits(reloaded, ids, mask), tuned)
    # the library's save refuses the PEFT wrapper, naming the two ways that work
    with pytest.raises(ValueError, match="got a PEFT PeftModel: save the adapter "
                       "with its own save_pretrained .* merge it"):
        mhc_hf.save_pretrained(reloaded, tmp_path / "full")
    assert not (tmp_path / "full").exists()
    merged = reloaded.merge_and_unload()  # the trained connections now call merged layers
    assert _rel(_logits(merged, ids, mask), tuned) <= 1e-5
    mhc_hf.save_pretrained(merged, tmp_path / "full")
    assert torch.equal(_logits(mhc_hf.from_pretrained(tmp_path / "full").eval(), ids, mask),
                       _logits(merged, ids, mask))


def test_lora_alone_leaves_the_connections_frozen():
    """Without modules_to_save the connections stay as converted: only LoRA trains."""
    ids, mask = _batch()
    model = peft.get_peft_model(_converted(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    model.train()
    _train(model, ids, mask, steps=2)


def test_auto_peft_refuses_an_adapter_whose_base_was_converted_in_process(tmp_path):
    """PEFT records the model's name_or_path as the adapter's base; after a conversion in the
    process that named the plain checkpoint, which AutoPeftModelForCausalLM loaded without the
    connections. The converted model's name says so instead; a folder saved by torch-mhc names
    itself, and AutoPeft then builds the converted base and the trained adapter on it."""
    ids, mask = _batch()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(
        tmp_path / "plain")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert plain.name_or_path == str(tmp_path / "plain")
    model = mhc_hf.convert(plain, "mhc", streams=4)
    assert model.name_or_path.startswith("refused by torch-mhc: ")
    assert str(tmp_path / "plain") in model.name_or_path  # what it was converted from
    assert model.config._name_or_path == str(tmp_path / "plain")  # model cards keep it
    mhc_hf.save_pretrained(model, tmp_path / "base")  # before PEFT wraps its connections
    peft_model = peft.get_peft_model(model, _lora_config())
    peft_model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(OSError, match="refused by torch-mhc: .* converted to mhc with 4 "
                       "streams in this process; no folder holds it: save it with "
                       "torch_mhc.hf.save_pretrained"):
        peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")

    # the documented way: the converted base saved, loaded from its folder, then trained
    base = mhc_hf.from_pretrained(tmp_path / "base")
    assert base.name_or_path == str(tmp_path / "base")
    tuned = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        modules_to_save=["mhc_attn", "mhc_mlp"], task_type="CAUSAL_LM"))
    tuned.train()
    _train(tuned, ids, mask, steps=2)
    tuned.eval()
    tuned.save_pretrained(tmp_path / "adapter2")
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter2",
                                                           trust_remote_code=True).eval()
    assert torch.equal(_logits(loaded, ids, mask), _logits(tuned, ids, mask))


def test_the_library_save_refuses_a_model_whose_connections_peft_wrapped(tmp_path):
    """get_peft_model wraps the connections named in modules_to_save inside the model it is
    given; saving that model would write their tensors under the wrapper's names, a folder
    that no load accepts. The save refuses it, naming the wrapped module and the two ways
    that work."""
    model = _converted()
    peft.get_peft_model(model, _lora_config())
    with pytest.raises(ValueError, match=r"got ModulesToSaveWrapper at "
                       r"model\.layers\.0\.mhc_attn \(PEFT's modules_to_save .*merge_and_unload"):
        mhc_hf.save_pretrained(model, tmp_path / "m")
    with pytest.raises(ValueError, match="ModulesToSaveWrapper"):
        model.save_pretrained(tmp_path / "m")  # the model's own save (Trainer's path)
    assert not (tmp_path / "m").exists()
