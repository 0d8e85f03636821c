"""GraphQL against the engine contract: a field added to one and not the other fails here, and every default
the API and the SDK's operation documents state is the contract's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest
from strawberry.utils.str_converters import to_camel_case

from app.schema import schema
from gpu_runtime import contract
from graphql import FieldNode, GraphQLInputObjectType, GraphQLObjectType, OperationDefinitionNode, parse, value_from_ast_untyped

OPERATIONS = Path(__file__).resolve().parents[2] / "graphql" / "operations"
SDL = schema._schema  # graphql-core's schema, which strawberry builds

# Request fields the GraphQL mutation does not take as an argument of the same name, and why.
NOT_ARGUMENTS: dict[str, str] = {
    "user_id": "the caller's key decides it",
    "run_id": "runId",  # present, camel-cased: checked below
    "return_outputs": "the resolver sets it when the client selects forwardBackward's `outputs`",
    "stream": "the OpenAI endpoint's streams (app/openai): GraphQL's sample answers once",
    "latest": "the OpenAI endpoint's run-id requests (off the run's queue); GraphQL's sample on a run keeps its order",
    "overwrite": "Tinker's save_weights(overwrite=True); GraphQL's saveState refuses a name in use (delete it first)",
    "messages": "/v1's one conversation, rendered in the sample call; GraphQL's `messages` (many) render apart",
    "tools": "/v1's tool definitions, rendered with its messages", "prefill": "/v1's forced tool-call opening",
    "history_tokens": "/v1's carried ids of an earlier turn", "history_through": "/v1's carried turn's index",
    "fit_context": "/v1 without max_tokens: cut to the context's room",
    "pieces": "/v1's per-token text, for a client without a tokenizer",
    "custom_loss": "Tinker's server-side custom losses (loss_fn custom): a graph its create_custom_loss stored",
    "prompt_alt_tokens_k": "Tinker's draws at each prompt position (SampleResponse.prompt_alt_tokens), its wire alone",
}
# Arguments of every primitive that the runtime never sees: the server orders calls by them (docs/ORDERING.md).
ORDERING_ARGUMENTS = ("seq", "session")
MUTATIONS: list[tuple[str, type[contract.Call]]] = [
    ("forwardBackward", contract.ForwardBackward),
    ("forward", contract.Forward),
    ("optimStep", contract.OptimStep),
    ("sample", contract.Sample),
    ("saveState", contract.SaveState),
    ("saveWeightsForSampler", contract.SaveWeightsForSampler),
    ("loadState", contract.LoadState),
]
# Arguments GraphQL takes that the runtime's request does not, and why.
GRAPHQL_ONLY: dict[str, str] = {
    "hfToken": "fetched by the server and passed to that one upload",
    "stopTokens": "GraphQL lists are typed: stop token ids arrive apart from stop strings, and join `stop`",
    "store": "whether the server writes sample rows; the runtime keeps none",
    "messages": "chat prompts, rendered by render_chat (as /v1's are) into the prompt token ids the runtime takes",
}
# Result fields GraphQL does not show, and why.
NOT_SHOWN: dict[str, str] = {
    "compute_seconds": "billed (a run's cost), not part of one call's answer",
    "replayed": "a retry's answer is the first answer; the API does not tell them apart",
    "size_bytes": "a checkpoint's size is sizeBytes on the Checkpoint row",
    "checkpoint_path": "a checkpoint row's path",
    "hub": "a checkpoint row's hubUrl",
    "piece_ids": "/v1's per-token text (Sample.pieces)", "pieces": "/v1's per-token text (Sample.pieces)",
    "metrics": "a Tinker custom loss's own metrics (custom/<name>:sum|mean), on Tinker's wire",
    "eos_token_ids": "/v1's rendered chat: the tokenizer query says it", "tool_format": "/v1's tool-call parser",
    "prompt_alt_tokens": "Tinker's draws at each prompt position (Sample.prompt_alt_tokens_k), on Tinker's wire",
}
RESULTS: list[tuple[str, type[contract.Result]]] = [
    ("ForwardBackwardResult", contract.ForwardBackwardResult),
    ("ForwardResult", contract.ForwardResult),
    ("OptimStepResult", contract.OptimStepResult),
    ("SampleResult", contract.SampleResult),
    ("LoadStateResult", contract.LoadStateResult),
]


@pytest.mark.parametrize(("mutation", "call"), MUTATIONS, ids=[m for m, _ in MUTATIONS])
def test_each_primitive_takes_the_contracts_arguments_with_its_defaults(mutation: str, call: type[contract.Call]) -> None:
    assert SDL.mutation_type is not None
    arguments = SDL.mutation_type.fields[mutation].args
    for field in dataclasses.fields(call):
        if field.name in NOT_ARGUMENTS and field.name != "run_id":
            continue
        name = to_camel_case(field.name)
        assert name in arguments, f"{mutation} lacks {name} (contract {call.__name__}.{field.name})"
        if field.default is not dataclasses.MISSING and field.name not in ("loss_fn_config", "adam"):
            default = arguments[name].default_value
            default = getattr(default, "value", default)  # an enum's default (SaveMode.ADAPTER)
            assert default == field.default, f"{mutation}.{name} defaults to {default!r}, the contract to {field.default!r}"
    assert set(ORDERING_ARGUMENTS) <= set(arguments), f"{mutation} lacks the SDK's ordering arguments"
    known = {to_camel_case(f.name) for f in dataclasses.fields(call)} | set(GRAPHQL_ONLY) | set(ORDERING_ARGUMENTS)
    assert set(arguments) - known == set(), f"{mutation} takes arguments the contract does not know"


@pytest.mark.parametrize(("type_name", "result"), RESULTS, ids=[t for t, _ in RESULTS])
def test_each_result_type_shows_the_contracts_fields(type_name: str, result: type[contract.Result]) -> None:
    shown = SDL.get_type(type_name)
    assert isinstance(shown, GraphQLObjectType)
    fields = {f.name for f in dataclasses.fields(result)}
    for name in fields - set(NOT_SHOWN):
        assert to_camel_case(name) in shown.fields, f"{type_name} lacks {to_camel_case(name)} (contract {result.__name__})"
    assert {f for f in shown.fields} <= {to_camel_case(n) for n in fields}, f"{type_name} shows what the contract lacks"


def test_a_batch_item_takes_exactly_the_contracts_keys() -> None:
    item = SDL.get_type("BatchItem")
    assert isinstance(item, GraphQLInputObjectType)
    assert set(item.fields) == {to_camel_case(key) for key in contract.ITEM_KEYS}  # modelInput: model_input


def _variable_defaults() -> list[tuple[str, str, str, Any]]:
    """(document, operation field, argument, default) for each variable with a default passed to an argument."""
    found = []
    for path in sorted(OPERATIONS.glob("*.graphql")):
        for definition in parse(path.read_text()).definitions:
            if not isinstance(definition, OperationDefinitionNode) or definition.operation.value != "mutation":
                continue
            defaults = {v.variable.name.value: value_from_ast_untyped(v.default_value)
                        for v in definition.variable_definitions or () if v.default_value is not None}
            for selection in definition.selection_set.selections:
                for argument in getattr(selection, "arguments", []):
                    variable = getattr(argument.value, "name", None)
                    if variable is not None and variable.value in defaults:
                        found.append((path.name, cast(FieldNode, selection).name.value, argument.name.value, defaults[variable.value]))
    return found


@pytest.mark.parametrize(("document", "field", "argument", "default"), _variable_defaults())
def test_operation_documents_default_to_what_the_schema_does(document: str, field: str, argument: str, default: Any) -> None:
    assert SDL.mutation_type is not None
    schema_default = SDL.mutation_type.fields[field].args[argument].default_value
    schema_default = getattr(schema_default, "value", schema_default)
    if isinstance(default, str) and hasattr(schema_default, "upper"):
        default = default.lower() if default.isupper() else default  # an enum literal (ADAPTER) against its value
    assert default == schema_default, f"{document}: ${argument} defaults to {default!r}, the API to {schema_default!r}"


# ---- Every other GraphQL type that mirrors a contract request or result, field by field.


@dataclasses.dataclass(frozen=True)
class Mirror:
    """A GraphQL type (or a root field's arguments) against the contract dataclass it stands for. Each field of
    one must be a field of the other, renamed, or listed with its reason: an entry that no longer applies fails too."""

    graphql: str  # a type's name, or "Query.field" / "Mutation.field" for a root field's arguments
    contract: type
    renamed: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # contract field: GraphQL names
    contract_only: dict[str, str] = dataclasses.field(default_factory=dict)  # contract field: why GraphQL lacks it
    graphql_only: dict[str, str] = dataclasses.field(default_factory=dict)  # GraphQL name: why the contract lacks it

    def graphql_fields(self) -> dict[str, Any]:
        if "." in self.graphql:
            root, field = self.graphql.split(".")
            parent = SDL.query_type if root == "Query" else SDL.mutation_type
            assert parent is not None
            return dict(parent.fields[field].args)
        shown = SDL.get_type(self.graphql)
        assert isinstance(shown, (GraphQLObjectType, GraphQLInputObjectType)), f"no GraphQL type {self.graphql}"
        return dict(shown.fields)


LORA_AS_FIELDS = ("loraR", "loraAlpha", "loraDropout", "loraTargetModules", "trainAttn", "trainMlp", "trainUnembed")
BILLED = "billed (the run's cost), not part of one call's answer"
TOKENIZER_DIR = "a path on the runtime's machine: only Tinker's get_info asks for it, on the local backend"
LABEL = "the run's label for people (issue 18 §1), kept by the server; the runtime never sees it"
REPLAYED = "a retry's answer is the first answer; the API does not tell them apart"
MIRRORS: list[Mirror] = [
    Mirror("CreateRunInput", contract.CreateRun,
           renamed={"lora": LORA_AS_FIELDS},
           contract_only={"run_id": "the server names a new run",
                          "user_id": "the caller's key decides it"},
           graphql_only={"learningRate": "an AdamW default the server keeps on the run; optimStep sends it",
                         "weightDecay": "an AdamW default the server keeps on the run; optimStep sends it",
                         "gradClipNorm": "an AdamW default the server keeps on the run; optimStep sends it",
                         "gpuConfig": "the pool's key: the server picks the runtime with it, which never sees it",
                         "name": LABEL, "tags": LABEL, "note": LABEL}),
    Mirror("Query.renderDatums", contract.RenderDatums),
    Mirror("Query.tokenizer", contract.Tokenizer,
           contract_only={"quantization": "the server reads it from the run or the catalogue, not the caller",
                          "save": TOKENIZER_DIR}),
    Mirror("SamplerSnapshot", contract.SaveWeightsForSamplerResult,
           contract_only={"path": "the runtime's own directory; a named snapshot's row has path and downloadUrl",
                          "size_bytes": "a named snapshot's size is sizeBytes on its row (Run.snapshots)",
                          "compute_seconds": BILLED, "replayed": REPLAYED}),
    Mirror("Checkpoint", contract.SaveStateResult,
           renamed={"hub": ("hubUrl",)},
           contract_only={"compute_seconds": BILLED, "replayed": REPLAYED},
           graphql_only={"id": "the row's key", "createdAt": "the row's", "expiresAt": "the row's (unnamed snapshots)",
                         "path": "signal://… built from the row; the contract's is checkpoint_path",
                         "downloadUrl": "the server's URL for the row"}),
    Mirror("TokenizerInfo", contract.TokenizerResult, contract_only={"directory": TOKENIZER_DIR}),
    Mirror("Mutation.deleteRun", contract.DeleteRun),
    Mirror("Mutation.deleteCheckpoint", contract.DeleteCheckpoint,
           renamed={"mode": ("checkpointId",), "name": ("checkpointId",)}),  # the row's id names its mode and name
    Mirror("Run", contract.RunDescription,
           renamed={"run_id": ("id",), "lora": ("loraR", "loraAlpha", "loraDropout"),
                    "target_modules": ("loraTargetModules",)},
           contract_only={"user_id": "the caller's own runs only: whose it is goes without saying",
                          "base_revision": "the runtime's record of the weights' revision; the catalogue names them",
                          "pending_forward_backward": "live runtime state; Run is read from the database",
                          "pending_tokens": "live runtime state; Run is read from the database",
                          "path": "the runtime's directory, not the caller's"},
           graphql_only={"status": "the database's (active, failed)",
                         "learningRate": "the server's AdamW defaults for the run", "optimizer": "the same, whole",
                         "gpuConfig": "the requested allocation, the server's", "computeSeconds": BILLED,
                         "gpuSeconds": BILLED, "cost": BILLED, "createdAt": "the row's", "updatedAt": "the row's",
                         "metrics": "the server's records", "samples": "the server's records",
                         "checkpoints": "the server's records", "snapshots": "the server's records",
                         "name": LABEL, "tags": LABEL, "note": LABEL,
                         "archivedAt": "the server's: an archived run's calls are refused before the runtime"}),
]
# Contract calls and results no GraphQL type mirrors, and why (the rest are above or in MUTATIONS / RESULTS).
NOT_IN_GRAPHQL: dict[str, str] = {
    "RenderChat": "the OpenAI endpoint's call (app/openai), not an API of its own",
    "RenderChatResult": "the same",
    "RenderDatumsResult": "renderDatums answers [Datum], checked against the contract's item keys",
    "LoadRun": "the server's restore of a run onto its runtime, under every call on it",
    "RunInfo": "the server's read of a run it just created or loaded; Run is read from the database",
    "CloseRun": "the server's eviction of a run from its runtime",
    "ExportCheckpoint": "the server's fetch of a checkpoint's files for Checkpoint.downloadUrl",
    "Ping": "the server's greeting to its runtime (the contract version)",
    "RuntimeState": "Query.runtime, as JSON (admins only)",
    "Cancel": "the OpenAI endpoint's stop of a stream whose client went away (app/openai)",
    "CancelResult": "the same",
    "SampleChunk": "a streamed sample's progress, which only the OpenAI endpoint asks for",
    "CloseRunResult": "CloseRun's acknowledgement",
    "DeleteRunResult": "deleteRun answers true",
    "DeleteCheckpointResult": "deleteCheckpoint answers true",
    "ExportCheckpointResult": "the archive Checkpoint.downloadUrl serves",
    "PingResult": "the runtime's greeting (the contract version), read by the server",
    "RuntimeStateResult": "Query.runtime, as JSON (admins only)",
}


@pytest.mark.parametrize("mirror", MIRRORS, ids=[m.graphql for m in MIRRORS])
def test_each_mirror_has_the_contracts_fields_and_no_others(mirror: Mirror) -> None:
    shown = set(mirror.graphql_fields())
    contract_fields = {f.name for f in dataclasses.fields(mirror.contract)}
    assert set(mirror.contract_only) <= contract_fields, "contract_only names a field the contract lacks"
    assert set(mirror.renamed) <= contract_fields, "renamed names a field the contract lacks"
    assert set(mirror.graphql_only) <= shown, f"graphql_only names a field {mirror.graphql} lacks"
    expected = set(mirror.graphql_only)
    for name in contract_fields - set(mirror.contract_only):
        expected |= set(mirror.renamed.get(name, (to_camel_case(name),)))
    assert sorted(shown - expected) == [], f"{mirror.graphql} has fields {mirror.contract.__name__} lacks"
    assert sorted(expected - shown) == [], f"{mirror.graphql} lacks fields of {mirror.contract.__name__}"


@pytest.mark.parametrize("mirror", [m for m in MIRRORS if "." in m.graphql or m.graphql.endswith("Input")],
                         ids=lambda m: m.graphql)
def test_each_mirrored_request_defaults_to_the_contract(mirror: Mirror) -> None:
    arguments = mirror.graphql_fields()
    for field in dataclasses.fields(mirror.contract):
        name = to_camel_case(field.name)
        if field.default is dataclasses.MISSING or name not in arguments:
            continue
        default = arguments[name].default_value
        assert getattr(default, "value", default) == field.default, f"{mirror.graphql}.{name}"


def test_create_run_takes_every_lora_setting_the_contract_defaults() -> None:
    names = {to_camel_case(key if key.startswith("train_") else f"lora_{key}") for key in contract.LORA_DEFAULTS}
    assert names <= set(LORA_AS_FIELDS)


def test_every_contract_type_is_mirrored_or_listed() -> None:
    mirrored = ({m.contract.__name__ for m in MIRRORS} | {c.__name__ for _, c in MUTATIONS}
                | {r.__name__ for _, r in RESULTS})
    results = {cls.__name__ for cls in vars(contract).values()
               if isinstance(cls, type) and issubclass(cls, contract.Result) and cls is not contract.Result}
    every = {cls.__name__ for cls in contract.CALLS.values()} | results
    assert sorted(every - mirrored - set(NOT_IN_GRAPHQL)) == []
    assert sorted(set(NOT_IN_GRAPHQL) & mirrored) == [], "listed as unmirrored, yet mirrored"


@pytest.mark.parametrize(("enum_name", "values"), [("LossFn", set(contract.LOSS_CONFIG_DEFAULTS)),
                                                   ("Reduction", set(contract.REDUCTIONS))])
def test_graphql_enums_name_every_loss_and_reduction_the_contract_has(enum_name: str, values: set[str]) -> None:
    """lossFn and reduction are enums (CROSS_ENTROPY, SUM): their values are the contract's spellings, every one."""
    from graphql import GraphQLEnumType

    enum = SDL.get_type(enum_name)
    assert isinstance(enum, GraphQLEnumType)
    assert {value.value for value in enum.values.values()} == values
    assert set(enum.values) == {value.upper() for value in values}
