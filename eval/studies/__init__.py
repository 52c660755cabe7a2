"""The studies built on the evaluation tool: one folder each, its recipe(s) and any one-off module.

    reference/     reference.sh: CommonsenseQA and GSM8K, the FS-GEN analysis and calibration
    handoff/       handoff.sh: what a hand-off costs with llama-server in tokens mode
    learned/       learned.sh, learned_scale.sh: the learned router
    structured/    structured.sh: GSM8K answered as JSON under a schema
    price_aware/   price_aware.sh: decisions that weigh the price, escalations, drafts
    hidden_state/  divergent_gsm8k.sh, hidden_router.py: hidden-state routers, divergent labels
    afresh/        afresh.sh, code_check.sh, early_check.sh, early_rating.py: asking afresh
    mixed/         mixed.sh, mixed_router.py, reliability.py: one router for mixed traffic
    history/       history.sh, history_features.py: routing-history features
    agreement/     gsm8k.sh, humaneval.sh, ifeval.sh, majority.sh (common.sh): agreement with own samples
    steering/      make_pairs.py, gsm8k_brevity.sh, gsm8k_answer_line.sh, routed.sh, summarize.py,
                   gsm8k_summary.py, routed_summary.py: control vectors (docs/steering.md)
    tuning/        csqa_handoff.sh: python -m gateway tune's token hand-offs (docs/tuning.md)

A recipe is a resumable bash script of `python -m eval` commands (run from anywhere; it changes to
the repository root); a module is run as `python -m eval.studies.<folder>.<module>`. What each
found, with the rows it was fitted, chosen and reported on: docs/results.md and docs/studies/.
The tool itself (datasets, runner, records, report, costs) is the rest of eval/: docs/evaluation.md.
"""
