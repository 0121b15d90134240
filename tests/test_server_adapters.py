"""LoRA runs served beside their base (core/serving/adapters.py): one server, one copy of the
base weights, each request decoded through the adapter its `model` names, side by side in one
step, giving what each run gives alone in process."""

import threading

import pytest
from test_server import client, metric, serving

from core import run
from tasks.nlp.lm import LanguageModel, LMTask

PROMPTS = ["the", "a b c"]


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Two LoRA runs on the tiny Llama, adapters of different ranks trained on different texts."""
    found = []
    for name, text, rank in (("verse", "the theme of the thing is the thread.\n", 2), ("prose", "a b c then x.\n", 4)):
        workdir = tmp_path_factory.mktemp("runs") / name
        workdir.mkdir()
        data = workdir.parent / f"{name}.txt"
        data.write_text(text * 100)
        overrides = [f"model.pretrained={str(tiny)!r}", f"model.lora_rank={rank}", "optim.learning_rate=0.05"]
        run.train(LMTask, workdir=workdir, preset="tiny", overrides=[*overrides, "train.steps=8"], data=str(data))
        found.append(workdir)
    return found


def test_each_request_decodes_through_the_adapter_it_names_beside_the_others(tmp_path, tiny, adapters):
    """The base and both runs served by one engine (the log says so): concurrent greedy
    completions to all three, in shared steps, equal each model's own in-process generation; the
    adapters do change the answers."""
    alone = {"tiny.gguf": LanguageModel(model=str(tiny))} | {w.name: LanguageModel(w) for w in adapters}
    expected = {
        (name, prompt): model.generate([prompt], max_new_tokens=12, temperature=0.0)[0]
        for name, model in alone.items()
        for prompt in PROMPTS
    }
    assert len({expected[name, "the"] for name in alone}) == 3  # each adapter changes the tokens
    workdirs = [option for w in adapters for option in ("--workdir", str(w))]
    with serving(tmp_path, "--model", str(tiny), *workdirs, "--max-batch", "8") as (_, url, log):
        said = log.read_text()
        assert "float32 weights (LoRA adapter 1 of 2, the base's shared with 2 LoRA adapters)" in said
        assert "prose (lm): LoRA adapter 2 of 2, on verse's engine." in said
        assert "tiny.gguf (lm): the base weights, on verse's engine." in said
        assert [m.id for m in client(url).models.list().data] == ["verse", "prose", "tiny.gguf"]
        answers = {}

        def ask(name, prompt):
            reply = client(url).completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            answers[name, prompt] = reply.choices[0].text

        threads = [threading.Thread(target=ask, args=key) for key in expected]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert answers == expected
        steps = metric(url, "apps_decode_slots_count", model="tiny.gguf")
        assert steps < len(expected) * 11  # requests of different adapters shared steps
