"""Generation as transformers does it, on CPU: tokenizer directories of each kind transformers writes
(Llama-3's BOS post-processor, GPT-2 / Qwen style without one, Llama-2 style with add_bos_token true or
false) encode prompts and render chat templates as AutoTokenizer and apply_chat_template do;
sampling filters as transformers' warpers; `serve.py mode=generate` prints LlamaForCausalLM.generate's
greedy completion, stopping at the first of several stop ids, alone and with tensor parallelism."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from configs.schema import ParallelConfig, ServeConfig  # noqa: E402
from model.args import ModelArgs  # noqa: E402
from model.chat import load_chat_template, read_messages, render_chat  # noqa: E402
from model.checkpoint import save_checkpoint  # noqa: E402
from model.generate import Sampling, generate, sample, sample_logits  # noqa: E402
from model.generation_config import (  # noqa: E402
    default_sampling,
    resolve_sampling,
    stop_ids,
    unapplied_settings,
)
from model.llama import Llama  # noqa: E402
from model.loading import checkpoint_tokenizer, resolve_checkpoint  # noqa: E402
from model.tokenizer import HF_TOKENIZER_FILES, ByteTokenizer, HFTokenizer, TextStream  # noqa: E402
from serve import prepare_completion  # noqa: E402
from tests.test_train_serve import run_script  # noqa: E402

CORPUS = [
    "naïve café ✓ — def f(x): return x " * 3,
    "the quick brown fox jumps over the lazy dog. Hello world! " * 5,
    "user assistant system You are a helpful assistant. " * 3,
]
TEXTS = ["the quick fox", " Hello  world!\n\tdef f(x):", "naïve café ✓ 日本", "<|im_end|> </s> <s>x", ""]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, naïve fox ✓"},
    {"role": "assistant", "content": "the lazy dog"},
    {"role": "user", "content": "def f(x): return x"},
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# ChatML as Qwen's, with tojson (non-ASCII kept, no HTML escaping) and loop controls.
CHATML_TEMPLATE = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% if message['role'] == 'assistant' and message['content'] == '' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }} {{ message['content'] | tojson }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
KINDS = ["llama3", "qwen", "llama2_bos", "llama2_no_bos"]


def byte_level_bpe(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def sentencepiece_bpe():
    """Llama-2's kind: SentencePiece-style BPE with byte fallback, '▁' for spaces, a decoder that
    strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Trained on words, run on whole texts: merges never span words, as SentencePiece's.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    spec = json.loads(tokenizer.to_str())  # the 256 byte tokens <0x00>..<0xFF> join the vocabulary
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def write_tokenizer_dir(directory: Path, kind: str) -> Path:
    """A tokenizer directory of `kind`, written by transformers' save_pretrained."""
    from tokenizers import processors

    if kind == "llama3":
        backend = byte_level_bpe(
            ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
        )
        backend.add_special_tokens(["<|end_header_id|>"])
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)],
        )
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
        )
        tokenizer.chat_template = LLAMA3_TEMPLATE  # saved as chat_template.jinja
    elif kind == "qwen":  # no post-processor; a named bos_token is never added (SmolLM's kind too)
        backend = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tokenizer = transformers.Qwen2TokenizerFast(
            tokenizer_object=backend,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            unk_token=None,
        )
        tokenizer.chat_template = CHATML_TEMPLATE
    else:
        add_bos = kind == "llama2_bos"
        tokenizer = transformers.LlamaTokenizerFast(
            tokenizer_object=sentencepiece_bpe(),
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            add_bos_token=add_bos,
        )
    tokenizer.save_pretrained(directory)
    if kind.startswith("llama2"):  # as transformers 4 wrote Llama-2's: the flag and template in the config
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config.update(add_bos_token=add_bos, add_eos_token=False, chat_template=LLAMA2_TEMPLATE)
        config_file.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_prompt_ids_match_autotokenizer(tokenizer_dir: Path) -> None:
    ours, reference = HFTokenizer(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    adds_bos = tokenizer_dir.name.startswith(("llama3", "llama2_bos"))
    assert reference.bos_token is not None  # named in every kind, added only by some
    assert (ours.encode_prompt("the fox")[0] == reference.bos_token_id) == adds_bos
    for text in TEXTS:
        ids = ours.encode_prompt(text)
        assert ids == reference(text)["input_ids"], text
        assert (
            ours.encode_prompt(text, special_tokens=False)
            == reference(text, add_special_tokens=False)["input_ids"]
        )
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_chat_matches_apply_chat_template(tokenizer_dir: Path) -> None:
    ours, reference = HFTokenizer(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    template = load_chat_template(tokenizer_dir)
    for messages in (MESSAGES, MESSAGES[1:2]):
        text = render_chat(template, messages, ours.special_tokens)
        assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert ours.encode_prompt(text, special_tokens=False) == expected


def test_chat_reasoning_reaches_the_template_under_each_name(tokenizer_dir: Path) -> None:
    """An assistant turn's reasoning, given as reasoning_content, thinking or reasoning, reaches a
    template that reads reasoning_content (Qwen3's) as apply_chat_template gives it."""
    ours, reference = HFTokenizer(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{% if m.reasoning_content is defined %}"
        "[{{ m.reasoning_content }}]{% endif %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    for key in ("reasoning_content", "thinking", "reasoning"):
        messages = [MESSAGES[1], {"role": "assistant", "content": "ok", key: "hmm"}, MESSAGES[1]]
        text = render_chat(template, messages, ours.special_tokens)
        assert "[hmm]ok" in text
        assert text == reference.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )


def test_a_messages_file_with_a_bom_is_read(tmp_path: Path) -> None:
    """Windows tools (PowerShell 5's Out-File -Encoding utf8) start UTF-8 files with a BOM."""
    file = tmp_path / "messages.json"
    file.write_bytes(b"\xef\xbb\xbf" + json.dumps(MESSAGES).encode())
    assert read_messages(file) == MESSAGES


def test_chat_template_errors_are_one_line(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path / "llama2", "llama2_bos")
    ours = HFTokenizer(directory)
    template = load_chat_template(directory)
    # Llama-2's template refuses two user turns in a row, through raise_exception.
    with pytest.raises(
        ValueError, match=r"^the chat template failed to render: Conversation roles must alternate"
    ):
        render_chat(template, [MESSAGES[1], MESSAGES[3]], ours.special_tokens)
    with pytest.raises(ValueError, match=r"failed to render: .*'endfor'") as err:
        render_chat("{% for m in messages %}{{ m }}{% endfor %}\n{% endfor %}", MESSAGES, {})
    assert "\n" not in str(err.value)


def test_text_stream_pieces_join_to_the_decoded_completion(tmp_path: Path) -> None:
    """Token by token, the streamed text equals what decoding prompt + completion adds to the decoded
    prompt: the space before a SentencePiece token kept, multi-byte characters never split."""
    for tokenizer in (HFTokenizer(write_tokenizer_dir(tmp_path / "sp", "llama2_bos")), ByteTokenizer()):
        ids = tokenizer.encode_prompt("the quick brown fox ✓ 日本 naïve!")
        split = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]) == "the quick")
        stream = TextStream(tokenizer, ids[:split])
        pieces = [stream.push(token) for token in ids[split:]]
        assert "\ufffd" not in "".join(pieces) and stream.flush() == ""
        assert "".join(pieces) == " brown fox ✓ 日本 naïve!"
    # A byte-fallback run that is not UTF-8 decodes to U+FFFDs as a whole ('@' included): held until closed.
    sentencepiece = HFTokenizer(tmp_path / "sp")
    prompt = sentencepiece.encode_prompt("the quick")
    completion = [sentencepiece.tokenizer.token_to_id(t) for t in ("<0x40>", "<0xFE>", "▁fox", "<0x40>")]
    stream = TextStream(sentencepiece, prompt)
    streamed = "".join(stream.push(token) for token in completion) + stream.flush()
    assert streamed == sentencepiece.decode(prompt + completion)[len("the quick") :] == "\ufffd\ufffd fox@"
    truncated = TextStream(ByteTokenizer(), [256])
    assert truncated.push(0xE2) == truncated.push(0x9C) == ""
    assert truncated.flush() == "\ufffd"


def test_text_stream_holds_bytes_across_a_skipped_special_token(tmp_path: Path) -> None:
    """A special token (skipped when decoding) inside a byte-fallback run does not end the run: the
    bytes before it are held until the run is closed, as the whole completion decodes them."""
    sentencepiece = HFTokenizer(write_tokenizer_dir(tmp_path / "sp", "llama2_bos"))
    prompt = sentencepiece.encode_prompt("the quick")
    tokens = ("<0x40>", "<unk>", "<0xFE>", "▁fox")
    completion = [sentencepiece.tokenizer.token_to_id(t) for t in tokens]
    stream = TextStream(sentencepiece, prompt)
    streamed = "".join(stream.push(token) for token in completion) + stream.flush()
    assert streamed == sentencepiece.decode(prompt + completion)[len("the quick") :] == "\ufffd\ufffd fox"


def test_text_stream_continues_a_prompt_ending_in_byte_fallback(tmp_path: Path) -> None:
    """A prompt whose last characters are byte-fallback tokens (CJK on Llama-2), then a completion
    that goes on in bytes: its characters are printed, not the U+FFFDs of the prompt's run decoded from
    the middle of a character."""
    sentencepiece = HFTokenizer(write_tokenizer_dir(tmp_path / "sp", "llama2_bos"))
    prompt = sentencepiece.encode_prompt("日本")
    assert set(prompt[-6:]) <= sentencepiece.byte_fallback_ids
    completion = [sentencepiece.tokenizer.token_to_id(f"<0x{b:02X}>") for b in "語".encode()]
    stream = TextStream(sentencepiece, prompt)
    streamed = "".join(stream.push(token) for token in completion) + stream.flush()
    assert streamed == sentencepiece.decode(prompt + completion)[len("日本") :] == "語"


def test_sampling_filters_as_transformers_warpers() -> None:
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    logits[0, :5] = 4.0  # ties at the k-th logit
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.3, 20, 0.5), (1.0, 5, 1.0), (0.5, 0, 0.01)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        torch.testing.assert_close(sample_logits(logits, temperature, top_k, top_p), expected)
    # A draw only ever picks a kept token; one generator seed gives one sequence of draws.
    kept = sample_logits(logits, 0.7, 0, 0.9).isfinite()
    draws = [sample(logits, 0.7, 0, 0.9, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and kept.gather(1, draws[0][:, None]).all()


def test_seeded_sampling_repeats() -> None:
    model = Llama(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden=96))
    model.init_weights()
    prompt = torch.randint(0, 97, (2, 5))
    hot = Sampling(temperature=1.5, top_k=0, top_p=0.95)

    def draw(seed: int) -> torch.Tensor:
        return generate(
            model, prompt, 16, hot, cuda_graph=False, generator=torch.Generator().manual_seed(seed)
        )

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    # No new tokens asked: none made (one was), and a negative count refused.
    assert generate(model, prompt, 0, hot, cuda_graph=False).shape == (2, 0)
    assert [len(generate(model, prompt, n, hot, cuda_graph=False)[0]) for n in (1, 2)] == [1, 2]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(model, prompt, -1, hot, cuda_graph=False)


def test_a_row_that_stops_first_is_padded_with_the_stop_id() -> None:
    """Batch 2, greedy: the row that meets a stop id first gets that id for the rest of the steps (as
    transformers pads it), while the other row completes as it would without stop ids."""
    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden=96))
    model.init_weights()
    prompt = torch.randint(0, 97, (2, 5))
    free = generate(model, prompt, 12, cuda_graph=False)
    j, stop = next(
        (j, t) for j, t in enumerate(free[0].tolist()) if t not in free[1] and t not in free[0, :j] and j < 8
    )
    got = generate(model, prompt, 12, stop_ids=[stop], cuda_graph=False)
    assert torch.equal(got[0, : j + 1], free[0, : j + 1]) and (got[0, j + 1 :] == stop).all()
    assert torch.equal(got[1], free[1])


def test_tiny_temperature_draws_the_most_likely_token() -> None:
    """1 / temperature overflows every logit to +-inf; the draw is still the argmax, not NaN."""
    logits = torch.randn(3, 50) * 10
    for temperature in (1e-45, 1e-46, 1e-300):  # the last two are 0 in float32
        assert torch.equal(sample(logits, temperature, top_p=0.9), logits.argmax(-1))


def test_stop_ids_and_sampling_defaults_from_files(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path, "llama3")
    tokenizer = HFTokenizer(directory)
    assert stop_ids(directory, tokenizer) == [2]  # <|eot_id|>, the tokenizer's end token
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    gen = {"eos_token_id": [1, 2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    assert stop_ids(directory, tokenizer) == [2, 1, 7]
    # transformers samples with top_k=50 when generation_config.json leaves it out.
    assert default_sampling(directory) == Sampling(temperature=0.6, top_k=50, top_p=0.9)
    assert resolve_sampling(directory, None, 0, None) == Sampling(0.6, 0, 0.9)
    assert resolve_sampling(directory, 0.0, None, None).temperature == 0
    assert default_sampling(tmp_path / "nothing") == Sampling() == default_sampling(None)
    assert resolve_sampling(None, None, None, None) == Sampling()  # random weights, no directory
    # A hand-edited value of the wrong type is named with its file (not cast: top_k 2.5 was taken as 2).
    file = directory / "generation_config.json"
    for key, value, what in (("temperature", "hot", "a number"), ("top_k", 2.5, "a whole number")):
        file.write_text(json.dumps({**gen, key: value}))
        with pytest.raises(ValueError, match=rf"^{file} sets {key}={value!r}, not {what}: fix the file"):
            default_sampling(directory)
    file.write_text(json.dumps(gen))
    with pytest.raises(ValueError, match=r"^top_k=-1 must be >= 0"):
        resolve_sampling(None, None, -1, None)
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"top_p={top_p} is outside \(0, 1\]"):
            resolve_sampling(directory, None, None, top_p)
    (directory / "generation_config.json").write_text(json.dumps({**gen, "top_p": 2.0}))
    with pytest.raises(ValueError, match=r"top_p=2.0 \(from .*generation_config\.json\) is outside"):
        resolve_sampling(directory, None, None, None)
    # top_k / top_p narrow a draw: asked for while decoding greedily, they would silently do nothing.
    with pytest.raises(ValueError, match=r"^top_k=40 narrow sampling, but the temperature is 0 \(greedy\)"):
        resolve_sampling(None, None, 40, None)
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False, "num_beams": 1}))
    with pytest.raises(ValueError, match=r"^top_p=0.5 .* temperature is 0 from .*generation_config\.json"):
        resolve_sampling(directory, None, None, 0.5)
    assert resolve_sampling(directory, 0.7, 40, 0.5) == Sampling(0.7, 40, 0.5)
    assert unapplied_settings(directory) == []
    extras = {"repetition_penalty": 1.5, "suppress_tokens": [], "min_p": 0.05, "no_repeat_ngram_size": 0}
    (directory / "generation_config.json").write_text(json.dumps(extras))
    assert unapplied_settings(directory) == ["repetition_penalty=1.5", "min_p=0.05"]
    # transformers 5's other warpers and stops: top-H sampling, classifier-free guidance, a watermark,
    # stop strings.
    extras = {
        "top_h": 0.4,
        "guidance_scale": 1.5,
        "watermarking_config": {"bias": 2.0},
        "stop_strings": ["\n"],
    }
    (directory / "generation_config.json").write_text(json.dumps(extras))
    assert [s.split("=")[0] for s in unapplied_settings(directory)] == list(extras)


def serve_config(checkpoint: Path | None, **overrides) -> ServeConfig:
    return ServeConfig(
        model=ModelArgs(), parallel=ParallelConfig(), mode="generate", checkpoint=checkpoint, **overrides
    )


def test_generate_inputs_are_checked_before_the_model_is_built(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    tiny_reference("qwen").save_pretrained(hf)
    args = ModelArgs(vocab_size=420, max_seq_len=256)
    with pytest.raises(ValueError, match=r"has no tokenizer\.json: add the model's tokenizer files"):
        prepare_completion(serve_config(str(hf)), hf, args)
    write_tokenizer_dir(hf, "qwen")
    (hf / "chat_template.jinja").write_text("{{ messages[0]['content'] | no_such_filter }}")
    with pytest.raises(ValueError, match=r"chat template failed to render: .*no_such_filter"):
        prepare_completion(serve_config(str(hf), chat=True), hf, args)
    with pytest.raises(ValueError, match=r"top_p=1\.5 is outside \(0, 1\]"):
        prepare_completion(serve_config(str(hf), top_p=1.5), hf, args)
    with pytest.raises(
        ValueError, match=r"chat=true but the tokenizer \(weft's byte tokenizer\) has no chat"
    ):
        prepare_completion(serve_config(None, chat=True), None, args)
    (hf / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=r"chat=true but the tokenizer \(.*hf\) has no chat template"):
        prepare_completion(serve_config(str(hf), chat=True), hf, args)
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps({"role": "user"}))
    with pytest.raises(ValueError, match=r"must hold a non-empty JSON list"):
        prepare_completion(serve_config(str(hf), messages=str(messages)), hf, args)
    messages.write_bytes('[{"role": "user", "content": "café"}]'.encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"^messages=.*messages\.json is not UTF-8 text \(.*\): save it as UTF"
    ):
        prepare_completion(serve_config(str(hf), messages=str(messages)), hf, args)
    messages.write_text(json.dumps(MESSAGES))
    with pytest.raises(
        ValueError, match=r"messages= is set but .* has no chat template: .*\(without messages=\)"
    ):
        prepare_completion(serve_config(str(hf), messages=str(messages)), hf, args)
    with pytest.raises(ValueError, match=r"exceeds model.max_seq_len=256"):
        prepare_completion(serve_config(str(hf), max_new_tokens=250), hf, args)


def test_a_quoted_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint='~/...' and messages='~/...' reach serve.py unexpanded when quoted (as Hydra's quoting
    advice has it): ~ is the home directory there too."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "chat.json").write_text(json.dumps(MESSAGES))
    assert read_messages("~/chat.json") == MESSAGES
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_checkpoint("~/hf") == tmp_path / "hf"


def test_max_new_tokens_unset_takes_generation_config_json(tmp_path: Path) -> None:
    """As transformers' generate: generation_config.json's max_new_tokens where serve.py's is unset."""
    hf = tmp_path / "hf"
    tiny_reference("qwen").save_pretrained(hf)
    write_tokenizer_dir(hf, "qwen")
    args = ModelArgs(vocab_size=420, max_seq_len=256)
    file = hf / "generation_config.json"
    config = {k: v for k, v in json.loads(file.read_text()).items() if k != "max_new_tokens"}
    file.write_text(json.dumps(config))
    assert prepare_completion(serve_config(str(hf)), hf, args).max_new_tokens == 64
    file.write_text(json.dumps({**config, "max_new_tokens": 10}))
    assert prepare_completion(serve_config(str(hf)), hf, args).max_new_tokens == 10
    assert prepare_completion(serve_config(str(hf), max_new_tokens=3), hf, args).max_new_tokens == 3
    file.write_text(json.dumps({**config, "max_new_tokens": 250}))
    with pytest.raises(ValueError, match=r"max_new_tokens=250 \(from .*generation_config\.json\) exceeds"):
        prepare_completion(serve_config(str(hf)), hf, args)
    for bad in (0, "10", True):
        file.write_text(json.dumps({**config, "max_new_tokens": bad}))
        with pytest.raises(ValueError, match=rf"sets max_new_tokens={re.escape(repr(bad))}, not a whole"):
            prepare_completion(serve_config(str(hf)), hf, args)
    # A prompt too long for the default: it is named as the default, with or without a checkpoint (with
    # none, or a byte-level one, there is no tokenizer directory to name: that was a TypeError).
    file.write_text(json.dumps(config))
    long_prompt = "a " * 250
    with pytest.raises(
        ValueError, match=r"max_new_tokens=64 \(from the default\) exceeds model\.max_seq_len=256"
    ):
        prepare_completion(serve_config(str(hf), prompt=long_prompt), hf, args)
    byte_args = ModelArgs(max_seq_len=256)
    with pytest.raises(
        ValueError, match=r"max_new_tokens=64 \(from the default\) exceeds model\.max_seq_len=256"
    ):
        prepare_completion(serve_config(None, prompt=long_prompt), None, byte_args)


def tiny_reference(kind: str) -> "transformers.LlamaForCausalLM":
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=420,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(KINDS.index(kind))
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: fewer near-ties between tokens
        model.lm_head.weight.mul_(20)
    return model


def expected_completion(
    model, reference_tokenizer, ids: list[int], stops: list[int]
) -> tuple[str, list[int]]:
    """LlamaForCausalLM.generate's greedy tokens, and the text they add to the decoded prompt."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=0,
        )
    new = out[0, len(ids) :].tolist()
    decode = lambda t: reference_tokenizer.decode(t, skip_special_tokens=True)
    return decode(ids + new)[len(decode(ids)) :], new


def hf_checkpoint(directory: Path, kind: str, prompt: str, chat: bool) -> tuple[Path, str, list[int]]:
    """A random tiny Llama with a `kind` tokenizer, its generation_config.json naming two of the
    tokens its greedy completion makes as stop ids; returns it, the expected printed completion and
    the expected new tokens."""
    model = tiny_reference(kind)
    write_tokenizer_dir(directory, kind)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    else:
        ids = reference(prompt)["input_ids"]
    _, free = expected_completion(model, reference, ids, [])
    # Two tokens of the free completion end it (the earlier one, the 7th token, must), and so does the
    # tokenizer's end token, as weft's stop ids have it.
    stops = [free[12], free[6], reference.eos_token_id]
    model.generation_config.eos_token_id = stops
    model.save_pretrained(directory)
    text, new = expected_completion(model, reference, ids, stops)
    assert len(new) <= 7 and new[-1] in stops
    return directory, text, new


def serve(checkpoint: Path, run_dir: Path, *overrides: str, tp: int = 1):
    args = [
        "mode=generate",
        f"checkpoint={checkpoint}",
        "device=cpu",
        "dtype=float32",
        "max_new_tokens=24",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    if tp > 1:
        args.append(f"parallel.tp={tp}")
    return run_script("serve.py", *args, torchrun=tp if tp > 1 else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_serve_prints_transformers_greedy_completion(tmp_path: Path, kind: str) -> None:
    prompt = "the quick brown fox"
    checkpoint, text, new = hf_checkpoint(tmp_path / "hf", kind, prompt, chat=False)
    done = serve(checkpoint, tmp_path / "run", f"prompt={prompt}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == prompt + text + "\n"
    assert f"{len(new)} new tokens, time to first token" in done.stderr
    # The first decode step (a compile or graph capture where asked) is reported apart from the rate.
    assert ("first decode step" in done.stderr) == (len(new) > 1)
    assert ("tokens/s" in done.stderr) == (len(new) > 2)


@pytest.mark.parametrize(("kind", "tp"), [("llama3", 1), ("qwen", 2)])
def test_serve_chat_matches_transformers(tmp_path: Path, kind: str, tp: int) -> None:
    """chat=true through serve.py (and a messages file, under torchrun with tensor parallelism)."""
    checkpoint, text, _ = hf_checkpoint(tmp_path / "hf", kind, "Hello naïve fox", chat=True)
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Hello naïve fox"}]))
    source = ["chat=true", "prompt='Hello naïve fox'"] if tp == 1 else [f"messages={messages}"]
    done = serve(checkpoint, tmp_path / "run", *source, tp=tp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == text + "\n"


def test_serve_tensor_parallel_plain_prompt(tmp_path: Path) -> None:
    prompt = "the quick brown fox"
    checkpoint, text, _ = hf_checkpoint(tmp_path / "hf", "llama2_bos", prompt, chat=False)
    done = serve(checkpoint, tmp_path / "run", f"prompt={prompt}", tp=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == prompt + text + "\n"


def test_init_from_and_export_keep_tokenizer_template_and_generation_config(tmp_path: Path) -> None:
    """train.py from a Hugging Face directory: the run directory and its export encode, render chats,
    stop and sample as the source does, in weft and in transformers."""
    source = tmp_path / "source"
    tiny_reference("llama3").save_pretrained(source)
    write_tokenizer_dir(source, "llama3")
    generation = {"eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (source / "generation_config.json").write_text(json.dumps(generation))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS * 4))
    run = tmp_path / "run"
    done = run_script(
        "train.py",
        f"checkpoint.init_from={source}",
        f"data.path={corpus}",
        "checkpoint.export_hf=true",
        "training.steps=2",
        "training.batch_size=2",
        "training.seq_len=32",
        "training.warmup_steps=1",
        "logging.progress_bar=false",
        "device=cpu",
        f"hydra.run.dir={run}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = transformers.AutoTokenizer.from_pretrained(source)
    expected_chat = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    for directory in (run, run / "hf"):
        ours = HFTokenizer(directory)
        theirs = transformers.AutoTokenizer.from_pretrained(directory) if directory != run else reference
        for text in TEXTS:
            assert ours.encode_prompt(text) == theirs(text)["input_ids"] == reference(text)["input_ids"]
        chat = render_chat(load_chat_template(directory), MESSAGES, ours.special_tokens)
        assert chat == expected_chat
        assert (
            theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == expected_chat
        )
        assert stop_ids(directory, ours) == [2, 1]  # <|eot_id|>, then generation_config.json's
        assert default_sampling(directory) == Sampling(temperature=0.6, top_k=50, top_p=0.9)
    exported = transformers.GenerationConfig.from_pretrained(run / "hf")
    assert (exported.eos_token_id, exported.do_sample, exported.top_p) == ([1, 2], True, 0.9)
    # A checkpoint copied out of its run has left its tokenizer behind: refused, not decoded as bytes.
    step = next((run / "checkpoints").glob("step_*"))
    moved = tmp_path / "elsewhere" / "a" / step.name
    shutil.copytree(step, moved)
    # The message lists every file the run keeps of the model: the chat template and generation defaults too.
    with pytest.raises(ValueError, match=r"was trained with a Hugging Face tokenizer, kept in its run.*"
                       r"chat_template\.jinja, generation_config\.json \(those it has\)"):  # fmt: skip
        checkpoint_tokenizer(moved)
    for name in HF_TOKENIZER_FILES:
        if (run / name).is_file():
            shutil.copyfile(run / name, moved / name)
    assert checkpoint_tokenizer(moved).encode_prompt(TEXTS[0]) == reference(TEXTS[0])["input_ids"]
    assert default_sampling(moved) == default_sampling(run)


def test_a_checkpoint_trained_on_bytes_decodes_bytes_below_another_tokenizer(tmp_path: Path) -> None:
    """A weft checkpoint of a byte-level run copied two levels below another model's tokenizer.json (a
    run directory's place): its meta.json says bytes, and bytes it decodes with, not the stranger's ids."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=264, ffn_hidden=48)
    model = Llama(args)
    model.init_weights()
    base = write_tokenizer_dir(tmp_path / "base", "llama3")
    step = save_checkpoint(base, 3, model, keep=1)  # base / checkpoints / step_00000003
    assert isinstance(checkpoint_tokenizer(step), ByteTokenizer)


def test_init_from_checks_seq_len_against_the_checkpoint(tmp_path: Path) -> None:
    """A checkpoint's own max_seq_len (256 here) bounds training.seq_len, not the preset's (1024); the
    message asks for what can change (model.max_seq_len comes from the checkpoint, and setting it is
    refused)."""
    source = tmp_path / "source"
    tiny_reference("llama3").save_pretrained(source)
    write_tokenizer_dir(source, "llama3")
    run = tmp_path / "run"
    done = run_script(
        "train.py",
        f"checkpoint.init_from={source}",
        "training.seq_len=512",
        "device=cpu",
        f"hydra.run.dir={run}",
    )
    assert done.returncode != 0
    assert "training.seq_len=512 exceeds the model's max_seq_len=256: lower training.seq_len\n" in (
        done.stdout + done.stderr
    )
    assert not run.exists()
    refused = run_script(
        "train.py", f"checkpoint.init_from={source}", "model=llama3_8b", "model.n_layers=2",
        "model.fp8=false", "device=cpu", f"hydra.run.dir={run}",
    )  # fmt: skip
    said = (
        "checkpoint.init_from gives the model's shape, so model=llama3_8b, model.n_layers=2 would be "
        "ignored: drop them (of model.*, only serve.py's decode choices model.fp8 and model.decode_kernels "
        "may be set)\n"
    )
    assert refused.returncode != 0 and said in refused.stdout + refused.stderr
    assert not run.exists()


def test_entry_points_share_helpers_from_below() -> None:
    """serve.py imports neither benchmarks/ nor train.py: shared helpers live in modules both use."""
    import ast

    root = Path(__file__).resolve().parent.parent
    tree = ast.parse((root / "serve.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    assert not {name for name in imported if name and name.split(".")[0] in ("benchmarks", "train")}
