"""A learned router: a logistic model over what the decoder knows at a step, served in numpy.

`features` turns a step's Signal into the vector the router was trained on (FEATURES names each
entry). A router file (JSON, written by `python -m eval calibrate --learn`) holds the feature
names, their standardisation, the weights, the score thresholds that route given shares of the
fit rows' tokens, and the SHA-256 of the local model it was trained for: its signals mean nothing
for another model, so `Router.load` refuses a file trained for a different one.

A file's `kind` says which model it holds: `logistic` (no `kind`, format @1, as every file before
it) or `mlp` (format @2, policies/mlp_router.py: the same features plus the local model's last
hidden state). `Router.load` reads either; both score a step with `score_signal` and say with
`reads_hidden` whether the step's Signal must carry the hidden state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.base import (
    LOCAL,
    UPSTREAM,
    Decision,
    Needs,
    PolicyArgs,
    PolicyDefaults,
    PolicyEntry,
    Route,
    RoutingState,
    Signal,
)
from policies.window import RecentValues, SharedWindows

if TYPE_CHECKING:
    from policies.mlp_router import MlpRouter

FORMAT = "routing-gateway/learned-router@1"
KINDS = ("word", "digit", "punct", "newline")  # one-hot; "piece" (inside a word) is the baseline
FEATURES = ("entropy", "top1", "margin", "p3", "p4", "tail", "log_position", "first", *(f"kind_{k}" for k in KINDS))
CORE_KEYS = ("format", "features", "model_sha256", "weights", "bias", "mean", "scale", "shares")  # the rest: meta


class RouterError(ValueError):
    """The router file cannot be used (unreadable, wrong format, another model's); one line."""


def features(signal: Signal) -> np.ndarray:
    """The FEATURES of one step, in order."""
    top = (*signal.top, 0.0, 0.0, 0.0, 0.0)[:4] if signal.top else (signal.top1, signal.top1 - signal.margin, 0.0, 0.0)
    return np.array([
        signal.entropy, signal.top1, signal.margin, top[2], top[3], max(0.0, 1.0 - sum(top)),
        math.log1p(signal.position), float(signal.position == 0), *(float(signal.kind == k) for k in KINDS),
    ])


@dataclass(frozen=True)
class Router:
    """A standardised logistic model: score = sigmoid(w . (x - mean) / scale + b), in [0, 1]."""

    weights: np.ndarray
    bias: float
    mean: np.ndarray
    scale: np.ndarray
    shares: dict[float, float]  # upstream share of the fit rows' tokens -> score threshold
    model_sha256: str
    meta: dict[str, Any]

    reads_hidden = False

    def score(self, x: np.ndarray) -> float:
        z = float(np.dot(self.weights, (x - self.mean) / self.scale)) + self.bias
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def score_signal(self, signal: Signal) -> float:
        """The score of one decoding step."""
        return self.score(features(signal))

    def threshold_for_share(self, share: float) -> float:
        """The score threshold for `share`, interpolated between the fitted shares; RouterError
        outside them (a share the router was not fitted near would silently be another)."""
        return threshold_for_share(self.shares, share)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "features": list(FEATURES), "model_sha256": self.model_sha256,
                "weights": self.weights.tolist(), "bias": self.bias, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "shares": {str(k): v for k, v in sorted(self.shares.items())},
                **{k: v for k, v in self.meta.items() if k not in CORE_KEYS}}

    @classmethod
    def load(cls, path: str | Path, model_sha256: str | None = None) -> "Router | MlpRouter":
        """Read a router file of either kind; RouterError if it is not one, or was trained for
        another model."""
        data = read_json(path, "router")
        if isinstance(data, dict) and data.get("kind", "logistic") != "logistic":
            from policies.mlp_router import MlpRouter  # it builds on this module

            if data["kind"] != "mlp":
                raise RouterError(f"{path} holds a router of kind {data['kind']!r}; this gateway serves "
                                  "'logistic' and 'mlp'")
            return MlpRouter.from_json(data, path, model_sha256)
        if not isinstance(data, dict):
            raise RouterError(f"{path} is not a router file ({FORMAT})")
        check_header(data, path, FORMAT, model_sha256)
        weights, bias, mean, scale = standardised_logistic(data, path, len(FEATURES))
        try:
            shares = {float(k): float(v) for k, v in data["shares"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RouterError(f"{path} is not a complete router file: {exc!r}") from exc
        if not shares:
            raise RouterError(f"{path} is not a usable router: shares need at least one threshold")
        return cls(weights, bias, mean, scale, shares, str(data["model_sha256"]),
                   {k: v for k, v in data.items() if k not in CORE_KEYS})


def read_json(path: str | Path, what: str) -> Any:
    """The JSON in `path`; RouterError (naming `what` the file should be) if it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RouterError(f"cannot read {what} {path}: {exc}") from exc


def standardised_logistic(data: dict[str, Any], path: str | Path, size: int, what: str = "router"
                          ) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """(weights, bias, mean, scale) of a file's standardised logistic model over `size` features;
    RouterError unless each vector holds `size` finite numbers (scale positive) and bias is finite."""
    try:
        weights, bias = np.array(data["weights"], dtype=float), float(data["bias"])
        mean, scale = np.array(data["mean"], dtype=float), np.array(data["scale"], dtype=float)
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterError(f"{path} is not a complete {what} file: {exc!r}") from exc
    if any(v.shape != (size,) or not np.isfinite(v).all() for v in (weights, mean, scale)) or \
            not (scale > 0).all() or not math.isfinite(bias):
        raise RouterError(f"{path} is not a usable {what}: weights, mean and scale need {size} finite numbers "
                          "each (scale positive)")
    return weights, bias, mean, scale


def check_header(data: dict[str, Any], path: str | Path, file_format: str, model_sha256: str | None,
                 features: tuple[str, ...] = FEATURES) -> None:
    """RouterError unless the file `data` is of `file_format`, reads `features` (those this
    gateway computes), and was trained for the local model `model_sha256` (None: any)."""
    if data.get("format") != file_format:
        raise RouterError(f"{path} is not a router file ({file_format})")
    if data.get("features") != list(features):
        raise RouterError(f"{path} was trained on features {data.get('features')}, this gateway computes "
                          f"{list(features)}")
    if not isinstance(data.get("model_sha256"), str):
        raise RouterError(f"{path} does not say which local model it was trained for (model_sha256)")
    if model_sha256 is not None and data.get("model_sha256") != model_sha256:
        raise RouterError(f"{path} was trained for the local model with sha256 {data.get('model_sha256')}, "
                          f"not {model_sha256}")


def threshold_for_share(shares: dict[float, float], share: float) -> float:
    """The score threshold for `share`, interpolated between the fitted `shares`; RouterError
    outside them (a share the router was not fitted near would silently be another)."""
    known = sorted(shares.items())
    xs, ys = [s for s, _ in known], [t for _, t in known]
    if not xs[0] <= share <= xs[-1]:
        fitted = ", ".join(f"{s:g}" for s in xs)
        raise RouterError(f"the router's thresholds are fitted for shares {fitted}: "
                          f"{share:g} is outside them (refit with `python -m eval thresholds --share ...`)")
    return float(np.interp(share, xs, ys))


@dataclass
class RouterPolicy(PolicyDefaults):
    """A policy that decides on a router's score of the step: the router reads the detailed signal
    (top-k probabilities, token kinds), and the hidden state where its file says so."""

    router: "Router | MlpRouter"
    detailed_signal = True

    @property
    def reads_hidden(self) -> bool:
        return self.router.reads_hidden


@dataclass
class LearnedAbove(RouterPolicy):
    """Route when the router's score (the predicted chance that the step carries its training
    label: the local token is not the upstream's, or, for a divergent-label router, changes the
    answer) exceeds the threshold."""

    threshold: float
    name: str = "learned"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        score = self.router.score_signal(signal)
        return Decision(Route.UPSTREAM, need=score) if score > self.threshold else LOCAL


@dataclass
class LearnedShare(RouterPolicy):
    """Route the `target` share of steps that the router scores highest on live traffic.

    The threshold is the (1 - target) quantile of the router's scores in `window` (shared by a
    tenant's requests on an alias), not the one fitted for `target` on the router's fit rows: a
    router fitted on one kind of text routes another kind's steps at a different rate (more where
    the local model is less sure of itself overall), and a share fitted on the upstream's text is
    not the share of the local model's own. Until the window holds `min_history` scores, the
    router's fitted threshold (`fallback`) decides. Which steps rank highest is the router's
    choice either way; only how many of them go upstream follows the traffic."""

    target: float
    window: RecentValues
    fallback: float
    min_history: int = 32
    name: str = "learned"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        score = self.router.score_signal(signal)
        self.window.add(score)
        threshold = self.window.quantile(1.0 - self.target) if len(self.window) >= self.min_history else self.fallback
        return Decision(Route.UPSTREAM, need=score) if score > threshold else LOCAL


@dataclass
class FirstTokens(PolicyDefaults):
    """Route the first `count` answer tokens and nothing else (a baseline: on CommonsenseQA the
    answer letter is the first token)."""

    count: int
    name: str = "first"

    def decide(self, signal: Signal, state: RoutingState) -> Decision:
        return UPSTREAM if signal.position < self.count else LOCAL


def build_learned(args: PolicyArgs) -> RouterPolicy:
    """The learned policy: a score `threshold`, or a `target_fraction` that `threshold_from`
    "router" turns into the router's threshold fitted for that share (RouterError outside the
    fitted shares) and "traffic" into the quantile of the scores in the window (LearnedShare)."""
    router = args.router
    if router is None:
        raise ValueError("policy 'learned' needs a router")
    if args.threshold_from not in ("router", "traffic"):
        raise ValueError(f"threshold_from is 'router' or 'traffic', not {args.threshold_from!r}")
    if args.threshold is not None:
        return LearnedAbove(router, args.threshold)
    if args.threshold_from == "traffic":
        fitted = sorted(router.shares)  # until the window fills: the nearest fitted share's threshold
        start = router.threshold_for_share(min(max(args.target_fraction, fitted[0]), fitted[-1]))
        return LearnedShare(router, args.target_fraction, (args.windows or SharedWindows()).scores, start)
    return LearnedAbove(router, router.threshold_for_share(args.target_fraction))


def whole_count(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the field, why) unless first's threshold is a count of tokens."""
    count = fields["threshold"]
    if count >= 1 and float(count).is_integer():
        return None
    return "threshold", "needs a whole number of tokens >= 1 as its threshold"


ROUTER = Needs(("router",), "a router")
SCORE_OR_SHARE = Needs(("threshold", "target_fraction"), "a threshold or target_fraction")
ENTRIES = (
    PolicyEntry("learned", build_learned, (ROUTER, SCORE_OR_SHARE)),
    PolicyEntry("first", lambda args: FirstTokens(int(args.threshold)), (Needs(("threshold",), "a threshold"),),
                check=whole_count),
)
