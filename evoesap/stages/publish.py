"""Stage `publish`: a pruned checkpoint with its model card, published as an artifact and pushed where it is released.

The artifact holds the prune artifact's checkpoint files (the quantize artifact's, when a quantized checkpoint of it
is given: it is then the model released), README.md (the model card, `evoesap.reporting.card`: Hub
metadata, method, per-layer expert counts, density plot, evaluation table with standard errors,
quantization, lineage) and density.png, plus the report's files under report/ when a report is given. Its
inputs are checked against each other before any work: every evaluation must be of the pruned model or of
the model it was pruned from, the search must be the one the model was pruned by, the report must cover
the pruned model's evaluation. The artifact is pushed, byte for byte with its manifest, to `to` (any fsspec
URI) and to the Hub repository `repo` before it is published at `out_uri`: a finished publish artifact means
every push went through, and a failed push publishes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from evoesap import network, records
from evoesap.errors import ArtifactError, ConfigError
from evoesap.params import StageParams, keyed, param
from evoesap.release import hub
from evoesap.reporting import card
from evoesap.store import artifacts, identity, lineage

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
REPORT_DIR = "report"


@dataclasses.dataclass(frozen=True)
class PublishParams(StageParams):
    """Where the checkpoint goes and what the card cannot read from the artifacts; what it says comes from them."""

    to: str | None = param(None, "Also push the published artifact to this fsspec URI (a path, s3://, gs://).")
    repo: str | None = param(None, "Also push it to this Hub model repository (org/name), in one commit.")
    token_env: str = param("HF_TOKEN", "Environment variable holding the Hub token (a secret; never logged or recorded).")
    endpoint: str | None = param(None, "Hub endpoint URL; unset: huggingface_hub's (HF_ENDPOINT, else huggingface.co).")
    private: bool = param(True, "Create the Hub repository private when it does not exist yet.")
    base_model: str | None = param(
        None, "Hub name of the base model, when the model was pruned from a local copy or URI of it (a hub base names itself)."
    )
    base_model_unverified: bool = param(
        False,
        "Publish base_model although it cannot be verified (the Hub cannot be asked, or answers that it does not "
        "exist); the card then says the base model was not verified.",
    )
    license: str | None = param(
        None,
        "License of the base model when its card names none (a license on the base "
        "model's card is carried and cannot be changed).",
    )
    digits: int = param(3, "Decimals in the evaluation table.", ge=1, le=8)
    show_locations: bool = param(
        False, "Write the inputs' and artifacts' paths and URIs into the card (internal locations; off for a public card)."
    )

    def __post_init__(self) -> None:
        for name in ("repo", "base_model"):
            value = getattr(self, name)
            if value is not None and (identity.hub_model(value) is None or "@" in value):
                raise ConfigError(f"{name} {value!r} is not a Hub repository name: give org/name")
        if self.base_model_unverified and self.base_model is None:
            raise ConfigError("base_model_unverified without base_model: give the base model's Hub name, or leave it off")
        if self.license is not None:
            card.check_license(self.license)
        if not self.token_env.isidentifier():
            raise ConfigError(f"token_env {self.token_env!r} is not an environment variable name")
        if self.to is not None:
            artifacts.split(self.to)  # credentials inside the URI are refused here
        if self.endpoint is not None:
            parts = urllib.parse.urlsplit(self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"endpoint {artifacts.redact(self.endpoint)!r} is not an http(s):// URL of a Hub")
            network.refuse_credentials(self.endpoint, "endpoint")
        super().__post_init__()  # declared ranges, then the bounds every stage shares


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The publish's inputs, read and checked against each other."""

    pruned: artifacts.Manifest
    pruned_eval: str | None
    full_eval: str | None
    quantized: artifacts.Manifest | None = None  # the quantize artifact published instead of the pruned checkpoint
    quantized_eval: str | None = None

    @property
    def published_eval(self) -> str:
        """The evaluation of the checkpoint this publish releases."""
        return self.quantized_eval or self.pruned_eval or ""


def _check_quantized(quantized_uri: str, pruned_uri: str) -> artifacts.Manifest:
    """The quantize artifact's manifest, refused unless it was made from the pruned checkpoint given."""
    quantized = artifacts.read_manifest(quantized_uri, "quantize")
    if not identity.same(quantized.inputs["model"], artifacts.artifact_identity(pruned_uri)):
        raise ConfigError(
            f"--quantized {artifacts.redact(quantized_uri)} quantized {quantized.inputs['model']['uri']}, not --pruned "
            f"{artifacts.redact(pruned_uri)}: give the quantize artifact of this pruned model"
        )
    return quantized


def _match_evaluations(pruned_uri: str, evaluations: Sequence[str], quantized_uri: str | None = None) -> _Inputs:
    """Which evaluation is of the pruned model, of its quantized checkpoint and of its base, by the identities their
    manifests record; an evaluation of any other model, or two of the same, is refused. The published checkpoint's
    evaluation (the quantized one's when given) is required."""
    pruned = artifacts.read_manifest(pruned_uri, "prune")
    quantized = _check_quantized(quantized_uri, pruned_uri) if quantized_uri else None
    checkpoints = [(pruned_uri, "pruned")] + ([(quantized_uri, "quantized")] if quantized_uri else [])
    made = [(artifacts.artifact_identity(uri), role) for uri, role in checkpoints]
    base = lineage.identity_of(pruned.inputs["model"])
    found: dict[str, str] = {}
    for uri in evaluations:
        entry = artifacts.read_manifest(uri, "evaluate").inputs["model"]
        role = next((r for made_id, r in made if identity.same(entry, made_id)), None) or (
            "full" if lineage.identity_of(entry) == base else None
        )
        if role is None:
            also = f", its quantized checkpoint {artifacts.redact(quantized_uri)}" if quantized_uri else ""
            raise ConfigError(
                f"--evaluations {artifacts.redact(uri)} evaluated {entry['uri']}, which is neither the pruned model "
                f"{artifacts.redact(pruned_uri)}{also} nor the model it was pruned from ({pruned.inputs['model']['uri']}): "
                "give the evaluations of these"
            )
        if role in found:
            raise ConfigError(
                f"--evaluations {artifacts.redact(found[role])} and {artifacts.redact(uri)} both evaluate "
                f"the {role} model: give one"
            )
        found[role] = uri
    published, name = (quantized_uri, "quantized") if quantized_uri else (pruned_uri, "pruned")
    if name not in found:
        raise ConfigError(
            f"no evaluation of the {name} model {artifacts.redact(published)} among --evaluations: run "
            f"`evoesap evaluate --model {artifacts.redact(published)}` and give its output"
        )
    return _Inputs(pruned, found.get("pruned"), found.get("full"), quantized, found.get("quantized"))


def _check_search(search: str, pruned: artifacts.Manifest, pruned_uri: str) -> None:
    artifacts.read_manifest(search, "search")
    if not identity.same(pruned.inputs.get("allocation", {}), artifacts.artifact_identity(search)):
        raise ConfigError(
            f"--search {artifacts.redact(search)} is not the search {artifacts.redact(pruned_uri)} was "
            "pruned by: give the prune artifact's --allocation, or leave --search out"
        )


def _check_report(report: str, pruned_eval: str) -> None:
    runs = artifacts.read_manifest(report, "report").inputs
    evaluated = artifacts.artifact_identity(pruned_eval)
    if not any(identity.same(entry, evaluated) for entry in runs.values()):
        raise ConfigError(
            f"--report {artifacts.redact(report)} does not cover the pruned model's evaluation "
            f"{artifacts.redact(pruned_eval)}: give a report made with it (evoesap report --runs ...)"
        )


def _base_card(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML metadata of the base model's own README.md at the version the prune read (its recorded identity);
    empty when there is none or it cannot be read."""
    from huggingface_hub import ModelCard

    try:
        if entry.get("kind") == "hub":
            from huggingface_hub import hf_hub_download

            fetch = lambda stop: hf_hub_download(entry["name"], CARD_FILE, revision=entry["revision"])  # noqa: E731
            text = Path(hub.bounded(fetch, f"reading the card of the Hub model {entry['name']}")).read_text()
        else:
            recorded = entry.get("files", {}).get(CARD_FILE, {}).get("sha256")
            data = artifacts.read_bytes(artifacts.join(entry["uri"], CARD_FILE)) if recorded else b""
            if not recorded or artifacts.sha256_bytes(data) != recorded:
                return {}  # no card, or not the one the prune read
            text = data.decode("utf-8")
        return ModelCard(text).data.to_dict()
    except Exception as exc:  # noqa: BLE001 - the base's card is optional: say so, carry nothing
        log.warning(
            "the base model's card could not be read (%s: %s); its license is not carried",
            type(exc).__name__,
            network.reply_line(exc),
        )
        return {}


def _base(entry: Mapping[str, Any], params: PublishParams) -> tuple[str | None, dict[str, str], bool]:
    """(hub name of the base model, the license keys its card names, else the one given, whether that name was
    verified)."""
    named = entry["name"] if entry.get("kind") == "hub" else None
    if params.base_model and named and params.base_model != named:
        raise ConfigError(
            f"base_model {params.base_model!r} contradicts the model the checkpoint was pruned from "
            f"({named}): leave base_model unset"
        )
    verified = True
    if params.base_model and not named:
        verified = _check_base_config(params.base_model, entry, params.base_model_unverified)
    carried = {k: str(v) for k, v in _base_card(entry).items() if k in card.LICENSE_KEYS and v}
    if "license" in carried:
        card.check_license(carried["license"], "the base model's card names license", "correct its README.md")
    if params.license and carried.get("license") not in (None, params.license):
        raise ConfigError(
            f"license {params.license!r} contradicts the base model's card ({carried['license']}): a "
            "pruned model keeps its base's license; leave license unset"
        )
    if not carried and params.license:
        carried = {"license": params.license}
    if not carried:
        log.warning("the base model's card names no license and none was given (--license): the card says so")
    return named or params.base_model, carried, verified


# config.json fields a checkpoint shares with the model it was trained or pruned from (expert counts change in pruning)
_SHAPE = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads")


def _check_base_config(base_model: str, entry: Mapping[str, Any], unverified: bool) -> bool:
    """Refuse a `base_model` whose config.json contradicts the shape of the model the checkpoint was pruned from (a
    team's own model, by path or URI), or that cannot be verified (the Hub cannot be asked, or has no such model)
    unless `unverified` allows it; whether it was verified."""
    try:
        from huggingface_hub import hf_hub_download

        ours = json.loads(artifacts.read_bytes(artifacts.join(entry["uri"], "config.json")))
        fetch = lambda stop: hf_hub_download(base_model, "config.json")  # noqa: E731
        theirs = json.loads(Path(hub.bounded(fetch, f"reading the config of the Hub model {base_model}")).read_text())
    except Exception as exc:  # noqa: BLE001 - any failure to read either config leaves the name unverified
        why = f"{type(exc).__name__}: {network.reply_line(exc)}"
        if not unverified:
            raise ConfigError(
                f"base_model {base_model!r} could not be verified against the pruned model's config ({why}): check the "
                "name and that the Hub can be reached, or pass base_model_unverified (--base-model-unverified) to "
                "publish it with a card that says it was not verified"
            ) from None
        log.warning("base_model %s was not verified against the pruned model's config (%s): the card says so", base_model, why)
        return False
    differ = [f"{k} {ours.get(k)!r} vs {theirs.get(k)!r}" for k in _SHAPE if k in ours and k in theirs and ours[k] != theirs[k]]
    if differ:
        raise ConfigError(
            f"base_model {base_model!r} contradicts the config of the model the checkpoint was pruned from "
            f"({'; '.join(differ)}): give the hub name it was trained from, or leave base_model unset"
        )
    return True


def _copy_payload(uri: str, manifest: artifacts.Manifest, dest: Path, skip: tuple[str, ...] = ()) -> None:
    """Every payload file of the artifact at `uri` but `skip` into `dest`, each checked against its manifest's sha256."""
    fs, root = artifacts.split(uri)
    for rel, expected in sorted(manifest.files.items()):
        if rel in skip:
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root.rstrip('/')}/{rel}", str(target))
        if artifacts.sha256_file(target) != expected:
            raise ArtifactError(
                f"{artifacts.redact(uri)}: {rel} does not match the sha256 in its manifest (truncated "
                f"or changed): {artifacts.rebuild_hint(manifest.stage)}"
            )


def run_publish(
    pruned: str,
    evaluations: Sequence[str],
    params: PublishParams,
    out_uri: str,
    *,
    search: str | None = None,
    report: str | None = None,
    quantized: str | None = None,
    gate: str | None = None,
) -> artifacts.Manifest:
    """Write the model card beside the pruned checkpoint (its quantized checkpoint, when `quantized` is given), push the
    artifact to `to` and `repo`, then publish it. With `gate`, only when that verdict passed the published model."""
    inputs = {
        "pruned": pruned,
        **{f"evaluations.{i}": u for i, u in enumerate(evaluations)},
        "search": search,
        "report": report,
        "quantized": quantized,
        "gate": gate,
    }
    seen = artifacts.preflight(out_uri, "publish", inputs)
    matched = _check_inputs(pruned, evaluations, search, report, quantized, gate)
    report_manifest = artifacts.read_manifest(report, "report") if report else None
    checkpoint, checkpoint_manifest = (
        (quantized, matched.quantized) if quantized and matched.quantized else (pruned, matched.pruned)
    )
    planned = {
        *checkpoint_manifest.files,
        CARD_FILE,
        card.DENSITY_FILE,
        artifacts.MANIFEST,
        *(f"{REPORT_DIR}/{rel}" for rel in (report_manifest.files if report_manifest else ())),
    }
    to_seen, secret = _check_targets(params, out_uri, inputs, planned)
    evidence = _evidence(inputs, matched, checkpoint, checkpoint_manifest, report_manifest, params)
    text = card.render_card(
        evidence, params.digits, params.show_locations
    )  # rendered before the copy: a broken record stops here
    push = _pusher(params, to_seen, secret, evidence)
    with artifacts.stage_output(out_uri, "publish", keyed(params), inputs, seen, before_publish=push) as staging:
        _copy_payload(checkpoint, checkpoint_manifest, staging, skip=(CARD_FILE,))  # the base model's card, which ours replaces
        if report is not None and report_manifest is not None:
            _copy_payload(report, report_manifest, staging / REPORT_DIR)
        card.write_density(evidence.pruning, staging / card.DENSITY_FILE)
        (staging / CARD_FILE).write_text(text)
    log.info(
        "published %s%s%s",
        artifacts.redact(out_uri),
        f", pushed to {artifacts.redact(params.to)}" if params.to else "",
        f", pushed to the Hub repository {params.repo}" if params.repo else "",
    )
    return artifacts.read_manifest(out_uri)


def _check_inputs(
    pruned: str,
    evaluations: Sequence[str],
    search: str | None,
    report: str | None,
    quantized: str | None,
    gate: str | None = None,
) -> _Inputs:
    """The inputs read and checked against each other: the evaluations (and quantize artifact) are of the pruned
    checkpoint, the gate passed the published model, the search made it, the report covers its evaluation."""
    matched = _match_evaluations(pruned, evaluations, quantized)
    if gate is not None:
        _check_gate(gate, matched.published_eval)
    if search is not None:
        _check_search(search, matched.pruned, pruned)
    if report is not None:
        _check_report(report, matched.published_eval)
    return matched


def _check_targets(
    params: PublishParams, out_uri: str, inputs: Mapping[str, str | None], planned: set[str]
) -> tuple[str | None, str]:
    """Before any copy: what `to` holds now, and the Hub token, with the repository checked to take `planned`."""
    to_seen = _check_to(params.to, out_uri, inputs)
    secret = hub.token(params.token_env) if params.repo else ""
    if params.repo:
        hub.check_target(params.repo, planned, endpoint=params.endpoint, secret=secret)
    return to_seen, secret


def _evidence(
    inputs: Mapping[str, str | None],
    matched: _Inputs,
    checkpoint: str,
    checkpoint_manifest: artifacts.Manifest,
    report_manifest: artifacts.Manifest | None,
    params: PublishParams,
) -> card.Evidence:
    """Every record the card shows, read and checked from the artifacts."""
    pruned, search, quantized = inputs["pruned"], inputs["search"], inputs["quantized"]
    base_model, license, verified = _base(matched.pruned.inputs["model"], params)
    return card.Evidence(
        pruning=records.read(pruned, records.PruningRecord),
        config=json.loads(artifacts.read_payload(checkpoint, "config.json", checkpoint_manifest)),
        pruned_eval=records.read(matched.pruned_eval, records.MetricsRecord) if matched.pruned_eval else None,
        full_eval=records.read(matched.full_eval, records.MetricsRecord) if matched.full_eval else None,
        search=records.read(search, records.AllocationRecord) if search else None,
        search_params=artifacts.read_manifest(search, "search").params if search else None,
        lineage=lineage.walk({k: v for k, v in inputs.items() if v is not None}, "publish"),
        base_model=base_model,
        base_model_verified=verified,
        license=license,
        report_files=tuple(report_manifest.files) if report_manifest else (),
        quantization=records.read(quantized, records.QuantizationRecord) if quantized else None,
        quantized_eval=records.read(matched.quantized_eval, records.MetricsRecord) if matched.quantized_eval else None,
    )


def _pusher(
    params: PublishParams, to_seen: str | None, secret: str, evidence: card.Evidence
) -> Callable[[Path, artifacts.Manifest], None]:
    """What runs on the finished staging directory before it is published: the copy to `to`, the Hub commit."""
    pruning = evidence.pruning

    def push(staging: Path, manifest: artifacts.Manifest) -> None:
        if params.to is not None and to_seen is not None:
            artifacts.publish_copy(staging, params.to, manifest, to_seen, "--to")
        if params.repo:
            hub.push(
                staging,
                params.repo,
                endpoint=params.endpoint,
                secret=secret,
                private=params.private,
                message=f"EvoESAP: {evidence.base_model or 'model'} pruned ({pruning.criterion}, "
                f"{pruning.sparsity:.0%}, {pruning.method})"
                + (f", quantized ({evidence.quantization.recipe})" if evidence.quantization else ""),
            )

    return push


def _check_gate(gate: str, published_eval: str) -> None:
    """Refuse, before any work, a verdict that failed or that judged another evaluation than the published model's."""
    from evoesap.release.gate import GateFailed

    judged = artifacts.read_manifest(gate, "gate").inputs["evaluation"]
    if not identity.same(judged, artifacts.artifact_identity(published_eval)):
        raise ConfigError(
            f"--gate {artifacts.redact(gate)} judged {judged.get('uri')}, not the published model's evaluation "
            f"{artifacts.redact(published_eval)}: give the gate of this evaluation"
        )
    verdict = records.read(gate, records.GateRecord)
    if not verdict.checks or verdict.reference is None:
        why = "checked nothing" if not verdict.checks else "did not check the model the candidate was pruned from"
        raise ConfigError(f"--gate {artifacts.redact(gate)} {why}, so it passes any model: re-run gate with thresholds")
    if not verdict.passed:
        raise GateFailed(f"{verdict.line()}; nothing published")


def _check_to(to: str | None, out_uri: str, inputs: Mapping[str, str | None]) -> str | None:
    """What `to` holds now (`artifacts.preflight`); None without `to`. `to` may not overlap `out_uri`."""
    if to is None:
        return None
    relation = artifacts.overlap(to, out_uri)
    if relation:
        raise ConfigError(
            f"--to {artifacts.redact(to)} {relation} --out {artifacts.redact(out_uri)}: give another place to push to"
        )
    try:
        return artifacts.preflight(to, "publish", inputs)
    except ConfigError as exc:  # its checks are --out's, for another place
        raise ConfigError(f"--to{str(exc).removeprefix('--out')}") from None
