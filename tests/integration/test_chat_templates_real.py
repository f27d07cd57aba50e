"""The real SmolLM2 GGUF's chat template: the exact prompt it renders and one BOS when tokenized."""

from __future__ import annotations

import pytest

import dgr
from dgr.serve.templates import ChatTemplate

pytestmark = pytest.mark.slow

# SmolLM2-135M-Instruct's tokenizer.chat_template: a default system message when the first
# message is not a system one, each message as <|im_start|>role\ncontent<|im_end|>\n, then
# <|im_start|>assistant\n for the generation prompt. Its BOS token is <|im_start|> (id 1) and
# its vocabulary does not add BOS (tokenizer.ggml.add_bos_token false).
SMOLLM2_HI = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def template(smollm2):
    return ChatTemplate.from_gguf(smollm2)


def test_smollm2_has_a_template_and_renders_its_exact_text(template):
    assert template.available
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    msgs = [{"role": "user", "content": "Hi"}]
    assert template.render(msgs) == SMOLLM2_HI
    assert template.render(msgs, add_generation_prompt=False) == \
        SMOLLM2_HI[:-len("<|im_start|>assistant\n")]
    sys_msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert template.render(sys_msgs) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_prompt_tokenizes_with_one_bos(template, smollm2):
    eng = dgr.Engine(smollm2, n_ctx=64)
    info = eng._info()
    text, add_bos = template.render_prompt([{"role": "user", "content": "Hi"}])
    assert (text, add_bos) == (SMOLLM2_HI, False)
    assert add_bos is info["add_bos"]                # the file's key agrees with the vocabulary
    bos = info["token_bos"]
    assert [int(t) for t in eng.tokenize("<|im_start|>", False, True)] == [bos]
    toks = [int(t) for t in eng.tokenize(text, add_bos, True)]
    assert toks[0] == bos and toks[1] != bos
    assert toks.count(bos) == text.count("<|im_start|>") == 3
    # with add_special on the tokens are the same: this vocabulary adds no BOS of its own
    assert [int(t) for t in eng.tokenize(text, True, True)] == toks
