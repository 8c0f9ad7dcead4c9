"""`streamrl sft` on the tiny model: a fixed mapping ("say X" -> "X") lowers the held-out loss, the adapter
in OUT loads with peft, and a second run resumes from OUT's checkpoint at the saved step."""

from __future__ import annotations

import json
import random

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from streamrl.cli import main
from streamrl.trainer.publish import META_FILE
from streamrl.trainer.sft import HISTORY_FILE

WORDS = ["apple", "river", "stone", "cloud", "green", "table", "music", "light", "paper", "winter", "orange",
         "silver", "garden", "rocket"]


def run(capsys, data, model, out, *flags: str) -> dict:
    code = main(["sft", str(data), "--model", str(model), "--out", str(out), "--step-tokens", "300",
                 "--eval-fraction", "0.2", "--eval-every", "5", "--save-every", "5", "--no-progress",
                 "--device", "cpu", *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_sft_learns_writes_adapter_and_resumes(tmp_path, tiny_model, capsys) -> None:
    rng = random.Random(0)
    data = tmp_path / "say.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
            for w in (rng.choice(WORDS) for _ in range(80))]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = tmp_path / "adapter"

    first = run(capsys, data, tiny_model, out, "--max-steps", "10")
    assert first["steps"] == 10 and first["resumed_at"] == 0 and first["skipped"] == {"bad_json": 1}
    assert first["held_out"] == 16 and first["eval_loss"] < first["eval_loss_first"] - 0.3
    assert json.loads((out / META_FILE).read_text())["step"] == 10

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert not torch.allclose(tuned, plain)  # the trained adapter, loaded by peft, changes the model

    second = run(capsys, data, tiny_model, out, "--max-steps", "15")
    assert second["resumed_at"] == 10 and second["steps"] == 15
    assert abs(second["eval_loss_first"] - first["eval_loss"]) < 1e-4  # the same weights it stopped with
    assert second["eval_loss"] < first["eval_loss"]
    steps = [json.loads(line)["step"] for line in (out / HISTORY_FILE).read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 16))  # steps 11..15 continue 1..10: nothing retrained, nothing skipped


def test_init_adapter_starts_from_the_sft_weights(tmp_path, tiny_model, capsys) -> None:
    """``--init-adapter`` (trainer and sft): the LoRA starts as the saved adapter computes, whatever
    ``lora_alpha`` (the saved scaling is folded into lora_B and rescaled on load)."""
    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.model import load_policy

    data = tmp_path / "say.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) for w in WORDS))
    out = tmp_path / "adapter"
    run(capsys, data, tiny_model, out, "--max-steps", "3", "--eval-fraction", "0")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    for alpha in (16.0, 32.0):
        model = load_policy(TrainerConfig(model=str(tiny_model), device="cpu", lora_alpha=alpha,
                                          init_adapter=str(out)), torch.device("cpu"))
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)


def test_publish_makes_the_adapter_the_next_version(broker, tmp_path, tiny_model, capsys) -> None:
    """``--publish``: the adapter in OUT, one past the newest version on the policy topic."""
    import uuid

    from streamrl.broker.policy_log import PolicyLog, adapter_record
    from streamrl.broker.schema import WEIGHTS_FILE, sha256_file
    from streamrl.broker.topics import Topics, create_topics

    topics = Topics(f"sft-{uuid.uuid4().hex[:6]}")
    create_topics(broker.bootstrap_servers, topics)
    out = tmp_path / "adapter"
    data = tmp_path / "say.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) for w in WORDS))
    log = PolicyLog(broker.bootstrap_servers, topics)
    try:
        log.publish(adapter_record("student", 3, _fake_adapter(tmp_path / "old", WEIGHTS_FILE), str(tiny_model)))
    finally:
        log.close()
    summary = run(capsys, data, tiny_model, out, "--max-steps", "2", "--publish", "--name", "student",
                  "--bootstrap-servers", broker.bootstrap_servers, "--topic-prefix", topics.prefix)
    assert summary["published"]["version"] == 4
    assert summary["published"]["sha256"] == sha256_file(out / WEIGHTS_FILE)
    assert summary["published"]["path"] == str(out.resolve())


def _fake_adapter(root, weights_file: str):
    root.mkdir(parents=True)
    (root / weights_file).write_bytes(b"an older version")
    return root
