"""Pre-training with a sink token, Xiao's thesis' Tables 4.3/4.4 study at tiny scale: three small Llama-style LMs
with the same architecture, seed, data and steps, pre-trained as
  - vanilla (softmax attention),
  - zero sink (SoftMax-off-by-one attention),
  - learnable sink token (a reserved token prepended to every training sample, its embedding learned),
then evaluated with leanlm's streaming evaluation at 0+W, 1+W and 4+W cache configurations (Table 4.3), with
ordinary windowed perplexity and the zero-shot average on a stated --limit (Table 4.4), and the attention mass
each layer puts on the first token. Writes benchmarks/results/sink_pretraining.json + .png.

    python benchmarks/sink_pretraining.py                      # 3 x 600 steps of 16 x 256 tokens (wall time in the JSON)
    python benchmarks/sink_pretraining.py --steps 20 --stream-tokens 4096 --limit 5   # a quick look
    python benchmarks/sink_pretraining.py --report                 # the saved tables

Data: the LAMBADA development novels and the Lee news corpus (training; a byte-level BPE of --vocab tokens is
trained on them first); WikiText-2 test then LAMBADA test for evaluation. Everything ships with leanlm's data.
"""

from __future__ import annotations

import argparse
import math
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers as hf  # noqa: E402

from leanlm.bench import Study, environment, print_report, study_arguments  # noqa: E402
from leanlm.data import plain_text, wikitext2_test_text  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.perplexity import perplexity  # noqa: E402
from leanlm.evaluation.streaming import attention_sink_mass, cached_nll, long_text_tokens  # noqa: E402
from leanlm.methods.streaming import StreamingConfig, sink_cache  # noqa: E402
from leanlm.nn.softmax_one import SOFTMAX_ONE  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402
from leanlm.training import PretrainSettings, as_transformers_tokenizer, pack_blocks, pretrain, train_bpe_tokenizer  # noqa: E402

SINK_TOKEN = "<sink>"
VARIANTS = {"vanilla": ("sdpa", None), "zero sink (softmax1)": (SOFTMAX_ONE, None), "sink token": ("sdpa", SINK_TOKEN)}


def model_config(args, vocab_size: int) -> hf.LlamaConfig:
    return hf.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def streaming_perplexities(model, tokenizer, args) -> dict:
    """Table 4.3: perplexity over one long stream, cache of --cache tokens as sinks + window."""
    tokens = torch.tensor(long_text_tokens(tokenizer, args.stream_tokens))
    results = {}
    for sinks in (0, 1, 4):
        cache = sink_cache(model, StreamingConfig(sinks=sinks, window=args.cache - sinks))
        nll = cached_nll(model, tokens, cache, chunk=16, desc=f"stream {sinks}+{args.cache - sinks}")
        results[f"{sinks}+{args.cache - sinks}"] = math.exp(nll.mean().item())
    return results


def plot_results(payload: dict, path) -> None:
    fig, (losses, mass, stream) = plt.subplots(1, 3, figsize=(16, 4.2))
    models = payload.get("models", {})
    for name, row in models.items():
        curve = torch.tensor(row["training"]["losses"])
        window = max(1, len(curve) // 20)
        losses.plot(range(window, len(curve) + 1), curve.unfold(0, window, 1).mean(dim=1), label=name)
        mass.plot(range(len(row["first_token_attention"])), row["first_token_attention"], marker="o", label=name)
    losses.set_xlabel("step")
    losses.set_ylabel("training loss (moving mean)")
    losses.legend(fontsize=8)
    mass.set_xlabel("layer")
    mass.set_ylabel("attention probability on the first token")
    mass.set_ylim(0, 1)
    mass.legend(fontsize=8)
    names = list(models)
    configs = list(next(iter(models.values()))["streaming"]) if names else []
    for offset, config in enumerate(configs):
        stream.bar(
            [i + 0.27 * (offset - 1) for i in range(len(names))],
            [models[n]["streaming"][config] for n in names],
            width=0.27,
            label=config,
        )
    stream.set_xticks(range(len(names)), names, fontsize=8)
    stream.set_ylabel("streaming perplexity")
    stream.set_yscale("log")
    stream.legend(fontsize=8, title="sinks+window")
    settings = payload["settings"]
    save_figure(
        fig,
        path,
        f"sink pre-training: {settings['layers']} layers x {settings['hidden']}, "
        f"{settings['steps']} steps x {settings['batch_size']} x {settings['seq_len']} tokens",
    )


def report(payload: dict) -> str:
    """Tables 4.3 and 4.4 as the README shows them."""
    models, settings = payload.get("models", {}), payload["settings"]
    configs = list(next(iter(models.values()))["streaming"]) if models else []
    return "\n".join(
        [
            f"Table 4.3 structure (streaming perplexity, cache of {settings['cache']} tokens = sinks + window):",
            "",
            format_table(
                ["pre-training", *configs],
                [[n, *(f"{r['streaming'][c]:.1f}" for c in configs)] for n, r in models.items()],
                markdown=True,
            ),
            "",
            "Table 4.4 structure (ordinary evaluation):",
            "",
            format_table(
                [
                    "pre-training",
                    "final train loss",
                    "WikiText-2 ppl",
                    f"zero-shot avg ({settings['limit']}/task)",
                    "attention on the first token, by layer",
                ],
                [
                    [
                        n,
                        r["training"]["losses"][-1],
                        f"{r['wikitext2_perplexity']:.1f}",
                        r["zero_shot_average"],
                        " / ".join(f"{mass:.2f}" for mass in r["first_token_attention"]),
                    ]
                    for n, r in models.items()
                ],
                markdown=True,
            ),
        ]
    )


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256, help="trained context (the sink token takes one slot)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cache", type=int, default=128, help="streaming cache size (sinks + window)")
    parser.add_argument("--stream-tokens", type=int, default=20000)
    parser.add_argument(
        "--eval-tokens", type=int, default=32768, help="first N WikiText-2 tokens, windows of --seq-len"
    )
    parser.add_argument("--limit", type=int, default=100, help="items per zero-shot task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.report:
        return print_report("sink_pretraining", report)

    started = time.perf_counter()
    study = Study(
        "sink_pretraining",
        {k: v for k, v in vars(args).items() if k not in ("resume", "only", "skip", "report")},
        args,
        plot=plot_results,
    )
    texts = [line for line in plain_text("lambada-dev").splitlines() if line.strip()] + [plain_text("lee")]
    bpe = train_bpe_tokenizer(texts, args.vocab, extra_special=(SINK_TOKEN,))
    plain_tokenizer = as_transformers_tokenizer(bpe)
    blocks = pack_blocks(plain_tokenizer, texts, args.seq_len - 1)  # one slot left for the sink token
    settings = PretrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    study.payload["training_tokens"] = blocks.numel()

    for name in study.todo("models", VARIANTS):
        attention, prefix = VARIANTS[name]
        tokenizer = as_transformers_tokenizer(bpe, prefix)
        torch.manual_seed(args.seed)
        model = hf.LlamaForCausalLM(model_config(args, bpe.get_vocab_size()))
        model.config._attn_implementation = attention
        parameters = sum(p.numel() for p in model.parameters())
        training = pretrain(model, blocks, settings, bpe.token_to_id(prefix) if prefix else None, desc=name)
        windowed = perplexity(
            model, tokenizer, wikitext2_test_text(), seq_len=args.seq_len, max_tokens=args.eval_tokens, desc="wikitext2"
        )
        zero_shot = evaluate(model, tokenizer, EvalSettings(tasks=ZERO_SHOT_TASKS, limit=args.limit))
        probe_texts = [line for line in plain_text("lambada-test").splitlines()[:64] if line.strip()]
        study.payload["wall_seconds"] = study.payload.get("wall_seconds", 0.0) + time.perf_counter() - started
        started = time.perf_counter()
        study.record(
            "models",
            name,
            {
                "parameters": parameters,
                "attention": attention,
                "prefix_token": prefix,
                "training": training,
                "streaming": streaming_perplexities(model, tokenizer, args),
                "wikitext2_perplexity": windowed.perplexity,
                "zero_shot_average": zero_shot["zero_shot_average"],
                "zero_shot": zero_shot["results"],
                "first_token_attention": attention_sink_mass(model, tokenizer, probe_texts, length=64),
            },
            summary=lambda row: (
                f"{row['parameters'] / 1e6:.1f}M parameters, loss {row['training']['losses'][-1]:.3f}, "
                f"streaming {row['streaming']}, wikitext2 {row['wikitext2_perplexity']:.2f}, "
                f"zero-shot {row['zero_shot_average']:.4f}"
            ),
        )
    print(report(study.payload))
    print(
        f"wall time {study.payload.get('wall_seconds', 0) / 60:.1f} min on this machine "
        f"({environment().get('cpu', '')}); wrote {study.path}"
    )


if __name__ == "__main__":
    main()
