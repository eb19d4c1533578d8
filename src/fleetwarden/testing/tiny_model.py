"""A deterministic tiny random-weight Llama, with a tokenizer trained here, for real vLLM to serve.

Owns: a deterministic tiny model and its cache.
Must not: download anything.

Nothing is downloaded: the weights are drawn from a seeded generator and the byte-level BPE
tokenizer is trained on text generated from a seeded word sampler. The same spec gives the same
files, byte for byte (the manifest lists their SHA-256), in another process or on another day,
with the same library versions.

The folder is cached by content: its name is a hash of the spec and :data:`BUILDER_VERSION`, and
its manifest, written last, marks it complete. A second call returns at once.

This file is also a script, and must stay one: torch, transformers and tokenizers live only in
the vLLM environment, never in fleetwarden's own. :func:`ensure_tiny_model` builds in-process
when the current interpreter has them, and otherwise runs this file by path under the vLLM
environment's Python. So it imports nothing from fleetwarden at module level, and the heavy
libraries only inside :func:`_build`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["BUILDER_VERSION", "MANIFEST", "TinyModelError", "TinyModelSpec", "ensure_tiny_model"]

#: Bump when the builder changes its output for the same spec: the cache key changes with it.
BUILDER_VERSION = 1

#: Written last into a built folder; its presence means the folder is complete.
MANIFEST = "fleetwarden-tiny-model.json"

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


class TinyModelError(RuntimeError):
    """The model could not be built; the message names the cause."""


@dataclass(frozen=True)
class TinyModelSpec:
    """What the model is. Every field goes into the cache key.

    ``head_dim`` must be one the CPU attention backend accepts (32, 64, 80, 96, 112, 128, …):
    16 starts fine and then kills the engine on its first request.
    """

    vocab_size: int = 768
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 512
    seed: int = 0
    corpus_sentences: int = 20_000

    def key(self) -> str:
        blob = json.dumps({"builder": BUILDER_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def folder_name(self) -> str:
        return f"tiny-llama-{self.key()}"


def ensure_tiny_model(
    cache_dir: str | os.PathLike[str] | None = None,
    spec: TinyModelSpec | None = None,
    *,
    python: str | os.PathLike[str] | None = None,
) -> Path:
    """Return the folder of the model for ``spec``, building it first if it is not cached.

    ``cache_dir`` defaults to ``<fleetwarden cache>/models``. When this interpreter lacks torch,
    transformers or tokenizers, the build runs under ``python``, by default the cached vLLM
    environment's (installed first if needed, see :func:`~fleetwarden.testing.vllm_env.
    ensure_vllm_env`). Raises :class:`TinyModelError` with the builder's output on failure.
    """
    spec = spec or TinyModelSpec()
    if cache_dir is None:
        from fleetwarden.testing.vllm_env import cache_root

        cache_dir = cache_root() / "models"
    cache = Path(cache_dir)
    target = cache / spec.folder_name()
    if (target / MANIFEST).exists():
        return target
    if python is None and _has_builder_libraries():
        return build_cached(cache, spec)
    if python is None:
        from fleetwarden.testing.vllm_env import ensure_vllm_env

        python = ensure_vllm_env()
    argv = [os.fspath(python), "-I", str(Path(__file__).resolve()),
            "--cache-dir", str(cache), "--spec", json.dumps(asdict(spec))]
    env = {**os.environ, **_OFFLINE}
    env.pop("PYTHONPATH", None)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TinyModelError(f"the tiny-model builder under {python} did not run: {e}") from e
    if done.returncode != 0 or not (target / MANIFEST).exists():
        output = (done.stdout + done.stderr).strip().splitlines()
        raise TinyModelError(
            f"the tiny-model builder under {python} failed (exit status {done.returncode}):\n"
            + "\n".join(output[-40:]))
    return target


def build_cached(cache_dir: Path, spec: TinyModelSpec) -> Path:
    """Build into ``cache_dir`` (needs torch, transformers, tokenizers in this interpreter).

    The build goes to a temporary folder renamed into place, under a file lock: two processes
    asking at once build once, and a crash mid-build leaves no folder that looks complete.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / spec.folder_name()
    with (cache_dir / (spec.folder_name() + ".lock")).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MANIFEST).exists():
            return target
        tmp = cache_dir / f".{spec.folder_name()}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)  # incomplete: it has no manifest
        _build(tmp, spec)
        tmp.rename(target)
    return target


def corpus(spec: TinyModelSpec) -> list[str]:
    """The tokenizer's training text: sentences drawn from a fixed word list by a seeded sampler,
    with numbers, punctuation and chat-shaped lines, so every common byte pattern gets merges."""
    rng = random.Random(spec.seed)
    words = _WORDS.split()
    lines = []
    for i in range(spec.corpus_sentences):
        n = rng.randint(4, 16)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        sentence = sentence[0].upper() + sentence[1:]
        if i % 7 == 0:
            sentence += f" {rng.randint(0, 9999)}"
        sentence += rng.choice((".", ".", ".", "?", "!", ",", ":"))
        if i % 11 == 0:
            sentence = rng.choice(("user", "assistant", "system")) + "\n" + sentence
        lines.append(sentence)
    return lines


def _has_builder_libraries() -> bool:
    return all(importlib.util.find_spec(m) is not None
               for m in ("torch", "transformers", "tokenizers"))


def _build(out: Path, spec: TinyModelSpec) -> None:
    os.environ.update(_OFFLINE)
    import tokenizers
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus(spec), trainer=trainer)
    if bpe.get_vocab_size() > spec.vocab_size:
        raise TinyModelError(f"tokenizer has {bpe.get_vocab_size()} tokens, the model "
                             f"{spec.vocab_size}")
    eos_id = bpe.token_to_id("<|im_end|>")
    pad_id = bpe.token_to_id("<|endoftext|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, chat_template=_CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Draw every weight here rather than trust transformers' init (it changes between
    # versions): a seeded generator, in a fixed order.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)

    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {
        "builder": BUILDER_VERSION, "spec": asdict(spec), "files": files,
        "tokens": bpe.get_vocab_size(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


# Plain words for the tokenizer's corpus; any fixed list will do, this one reads like English.
_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work
part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late
run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river
car feet care second book carry took science eat room friend began idea fish mountain stop
once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure
door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach week final
gave green oh quick develop ocean warm free minute strong special mind behind clear tail
produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead
dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring
yes distant fill east paint language among engine fleet shard router token model request
"""


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tiny model into a cache folder.")
    parser.add_argument("--cache-dir", required=True, type=Path)
    parser.add_argument("--spec", default="{}", help="TinyModelSpec fields as JSON")
    args = parser.parse_args(argv)
    spec = TinyModelSpec(**json.loads(args.spec))
    print(build_cached(args.cache_dir, spec))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
