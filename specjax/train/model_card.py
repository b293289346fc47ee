"""The README.md written next to an exported draft: what it is, how it was trained and how well it drafts.

The lines that differ between kinds of draft are a `CardText` of each kind (`Eagle3Card`, `DFlashCard`), which the
run's `DraftKind` (specjax/train/kinds.py) names; the rest is shared.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path

import yaml

from specjax.models.dflash import DFlashConfig
from specjax.models.eagle3 import Eagle3Config
from specjax.train.config import TrainConfig, config_to_dict


class CardText(abc.ABC):
    """What the model card of one kind of draft says of it."""

    # How the standard-library answers are labelled (after "... as assistant answers, ").
    source_labels: str
    notes: tuple[str, ...] = ()  # lines after the data lines

    @abc.abstractmethod
    def draft_section(self, cfg: TrainConfig, draft_cfg, covers: str, taps: str) -> list[str]:
        """The title and the draft's section, from the run's config and the draft's, with the shared phrases of the
        vocabulary's coverage (`covers`) and of the taps (`taps`)."""

    @abc.abstractmethod
    def objective(self, cfg: TrainConfig) -> str:
        """The training objective, in one phrase."""


class Eagle3Card(CardText):
    source_labels = "labelled by the target"
    notes = (
        "- the loss mask is shifted together with the labels (a row counts when the token it predicts is",
        "  assistant content); the EAGLE and SpecForge trainers leave it unshifted",
    )

    def draft_section(self, cfg: TrainConfig, draft_cfg: Eagle3Config, covers: str, taps: str) -> list[str]:
        return [
            f"# EAGLE-3 draft head for `{cfg.model.target}`",
            "",
            "Trained with specjax (`specjax-train`). Layout: `LlamaForCausalLMEagle3` (config.json + model.safetensors",
            "with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), readable by vLLM, SGLang and the EAGLE "
            "repository.",
            "",
            "## Head",
            f"- hidden {draft_cfg.hidden_size}, {draft_cfg.num_heads} heads / {draft_cfg.num_kv_heads} KV heads, MLP "
            f"{draft_cfg.intermediate_size}, draft vocabulary {draft_cfg.draft_vocab_size} of "
            f"{draft_cfg.vocab_size}{covers}",
            taps,
            "- the token embedding is the target's (not stored)",
            "",
        ]

    def objective(self, cfg: TrainConfig) -> str:
        return f"training-time test over {cfg.training.ttt_length} steps (loss weights {cfg.training.step_decay}^k)"


class DFlashCard(CardText):
    source_labels = "their own tokens the labels"

    def draft_section(self, cfg: TrainConfig, draft_cfg: DFlashConfig, covers: str, taps: str) -> list[str]:
        stack = draft_cfg.layers
        return [
            f"# DFlash draft for `{cfg.model.target}`",
            "",
            "Trained with specjax (`specjax-train`). Layout: the published DFlash draft (config.json with",
            "`dflash_config` + model.safetensors with `fc`, `hidden_norm`, `layers.*`, `norm`), plus specjax's",
            "`vocab_ids` (the draft vocabulary) when it scores fewer tokens than the target's.",
            "",
            "## Draft",
            f"- {stack.num_layers} decoder layer(s), hidden {stack.hidden_size}, {stack.num_heads} heads / "
            f"{stack.num_kv_heads} KV heads, MLP {stack.intermediate_size}; block size {draft_cfg.block_size} (up to "
            f"{draft_cfg.max_drafts} drafts a round), mask token {draft_cfg.mask_token_id}",
            f"- draft vocabulary {cfg.model.draft_vocab_size} of {stack.vocab_size}{covers}",
            taps,
            "- the token embedding and LM head are the target's (not stored)",
            "",
        ]

    def objective(self, cfg: TrainConfig) -> str:
        d = cfg.dflash
        return (
            f"block loss over {d.num_anchors} random anchors per row (position weights "
            f"exp(-(k-1)/{d.loss_decay:g})), labels the target's own tokens"
        )


def _last_metrics(path: Path, lines: int = 5) -> list[dict]:
    """The last metric records (one batch each is noisy: the card averages a few)."""
    return [json.loads(line) for line in path.read_text().splitlines()[-lines:]] if path.exists() else []


def _starting_head(card: str | None) -> list[str]:
    """The data and training sections of the starting head's card, one heading level down, so a head continued
    several times carries its whole history; nothing when the card has no such sections (a head from elsewhere)."""
    lines = (card or "").splitlines()
    if "## Data" not in lines or "## Evaluation" not in lines:
        return []
    kept = lines[lines.index("## Data") : lines.index("## Evaluation")]
    return ["## Starting head", "", *("#" + line if line.startswith("#") else line for line in kept)]


def model_card(
    cfg: TrainConfig,
    text: CardText,
    draft_cfg,
    manifest: dict,
    synthetic: dict | None,
    coverage: float | None,
    evaluation: dict | None,
    start_card: str | None = None,
) -> str:
    """Markdown model card of an exported draft (`text`: its kind's lines, `DraftKind.card`; `synthetic`: the
    synthesize stage's manifest, if any; `start_card`: the card of the `training.init_from` head)."""
    last = _last_metrics(cfg.output_path / "train" / "metrics.jsonl")
    acc = ", ".join(f"{sum(a) / len(a):.3f}" for a in zip(*(m["acc_k"] for m in last))) if last else "n/a"
    steps = last[-1]["step"] if last else 0
    covers = f" (covers {coverage:.2%} of the tokens the target wrote)" if coverage is not None else ""
    taps = (
        f"- taps: the residual stream entering target layers {list(draft_cfg.tap_layers)} "
        f"(outputs of layers {[t - 1 for t in draft_cfg.tap_layers]})"
    )
    lines = [
        *text.draft_section(cfg, draft_cfg, covers, taps),
        "## Data",
        f"- prompt sources: {', '.join(f'`{p}`' for p in cfg.data.prompt_sources)}; "
        f"{manifest.get('conversations', '?')} training conversations, {cfg.data.eval_prompts} held out, "
        f"{manifest.get('dropped_overlapping_evaluation', 0)} dropped for resembling an evaluation prompt",
        *(
            [
                f"- self-written prompts (synthesize stage): {synthetic['kept']} kept of {synthetic['generated']} "
                f"generated; dropped: {synthetic['dropped']}; kept by domain: {synthetic['kept_by_domain']}"
            ]
            if synthetic
            else []
        ),
        "- responses regenerated by the target itself through its chat template: greedy"
        + (
            f" plus {cfg.data.samples_per_prompt} sampled (temperature {cfg.data.sample_temperature}, top-p "
            f"{cfg.data.sample_top_p})"
            if cfg.data.samples_per_prompt
            else ""
        )
        + f", at most {cfg.data.max_new_tokens} tokens; {manifest.get('samples', '?')} samples, "
        f"{manifest.get('assistant_tokens', '?')} assistant tokens; loss on assistant tokens only",
        f"- cut or dropped while regenerating: {manifest.get('cut_or_dropped', {})}",
        *(
            [
                f"- plus {manifest['source_samples']} blocks of the Python {manifest.get('python', '')} standard "
                f"library's source ({manifest['source_tokens']} tokens) as assistant answers, " + text.source_labels
            ]
            if manifest.get("source_samples")
            else []
        ),
        *text.notes,
        "",
        "## Training",
        f"- {steps} steps of {cfg.training.batch_size} packed rows x {cfg.training.seq_len} tokens, "
        f"{text.objective(cfg)}, target features {cfg.training.features}",
        f"- final accuracy per draft position (agreement with the target's token on assistant rows, mean of the last "
        f"{len(last)} logged steps): {acc}",
        *(
            [
                f"- these steps continue the head `{cfg.training.init_from}` (its weights and draft vocabulary, a "
                "fresh optimiser), whose own data and training follow"
            ]
            if cfg.training.init_from
            else []
        ),
        "",
        *_starting_head(start_card),
        "## Evaluation",
    ]
    if evaluation:
        lines.append(
            f"Greedy speculative decoding (at most {evaluation['max_new_tokens']} new tokens), checkpoint of step "
            f"{evaluation['step']}:"
        )
        for set_name, result in evaluation["sets"].items():
            for name, e in result.items():
                if name == "prompts":
                    continue
                by_pos = ", ".join(f"{a:.2f}" for a in e["acceptance_by_position"])
                lines.append(
                    f"- {set_name} ({result['prompts']} prompts), {name} ({e['drafts']}): mean accepted length "
                    f"{e['mean_accepted']:.2f} tokens per target forward (bonus included); acceptance by draft "
                    f"position {by_pos}"
                )
    else:
        lines.append("- not evaluated")
    lines += ["", "## Config", "```yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)
