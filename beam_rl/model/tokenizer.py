"""Offline tokenizers: a tiny Qwen-style byte-level BPE trained in code, or a local pretrained one.

No hub access exists here, so tests and local runs use the tiny tokenizer; real runs point
`load_tokenizer` at a local model directory.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
TINY_VOCAB_SIZE = 512

# Qwen2's pre-tokenizer split: single digits, so arithmetic tokenizes one digit at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML with Qwen2.5's tool calling: `tools` listed in the system turn, an assistant's
# `tool_calls` written as <tool_call> JSON blocks, `tool` messages answered inside one user turn as
# <tool_response> blocks. Messages without tools render exactly as plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it you that was for on are with as be at this have from or one by "
    "what all we when your can said there use each which do how their if will up other about out "
    "many then them these so some would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find long down day "
    "did get come made may part answer question reverse word letter letters string sum add plus "
    "minus times equals result correct wrong final think step solve compute count number numbers "
    "user assistant system please give only reply hello world yes true false game guess higher "
    "lower right left play move turn score reward done try again"
)


def _tiny_corpus() -> list[str]:
    """A small fixed corpus: words, digits, arithmetic and reversals, so BPE learns useful merges."""
    words = _WORDS.split()
    lines = [_WORDS, _WORDS.capitalize() + ".", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    for a in range(0, 40, 3):
        for b in range(0, 25, 4):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a} * {b} = {a * b}. {a} - {b} = {a - b}")
    for i, word in enumerate(words):
        lines.append(f"Reverse the word '{word}': {word[::-1]}")
        lines.append(f"What is {i} + {len(word)}? The answer is {i + len(word)}.")
    return lines


def _train_tiny_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: lossless
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return tokenizer


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE (deterministic, offline, milliseconds) and wrap it for transformers."""
    # Imported here: transformers takes seconds to import, the constants above are needed more often.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_bpe(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | pathlib.Path) -> None:
    """`save_pretrained`, made loadable by transformers 4.x too (hence by any vLLM release).

    transformers 5 records its internal class name `TokenizersBackend`, unknown to 4.x, and keeps
    the chat template only in `chat_template.jinja`; we write the portable class name and inline
    the template in `tokenizer_config.json` as well.
    """
    directory = pathlib.Path(directory)
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2) + "\n")


@functools.lru_cache(maxsize=1)
def _cached_tiny() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


def load_tokenizer(name: str = "tiny") -> PreTrainedTokenizerBase:
    """ "tiny" -> the (shared, cached) tiny tokenizer; anything else -> a local pretrained tokenizer.

    Callers must not mutate the returned tiny tokenizer: every caller in the process shares it.
    """
    if name == "tiny":
        return _cached_tiny()
    from transformers import AutoTokenizer

    path = pathlib.Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer {name!r}: no such local path (only 'tiny' or a local directory work offline)"
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
