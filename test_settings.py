"""The rules settings.py keeps: every setting declared once, in one group, with help; every command's
flags are its settings' fields, and nothing else besides its few command options."""
import argparse
import dataclasses
import os

import pytest

import run
import settings


def groups():
    """Every settings group: a class of settings.py that declares fields of its own."""
    return [c for c in vars(settings).values()
            if isinstance(c, type) and issubclass(c, settings.Settings) and c.__dict__.get("__annotations__")
            and not hasattr(c, "FLAGS")]


# the command-line options that are not settings: how a command runs, never what it computes
COMMAND_OPTIONS = {"help", "preset", "dry_run", "stage", "no_resume", "out"}
COMMANDS = {"train": settings.TrainConfig, "eval": settings.EvalConfig, "demo": settings.DemoConfig,
            "rerank-eval": settings.RerankEvalConfig, "attack": settings.AttackConfig,
            "harden": settings.HardenConfig, "build-bench": settings.BuildConfig, "holdout": settings.HoldoutConfig,
            "deploy-check": settings.DeployCheckConfig, "bench": settings.BenchConfig,
            "compare": settings.CompareConfig, "export": settings.ExportConfig, "serve": settings.ServeConfig,
            "bench-audit": settings.AuditConfig, "serve-offline": settings.ServeOfflineConfig,
            "detect": settings.DetectConfig}


# one name, two settings of commands that never compose both: attack's attacker rounds, harden's hardening
# rounds; serve's port and the offline engine's
HOMONYMS = {"rounds": {"AttackSettings", "HardenSettings"}, "port": {"ServeSettings", "EngineSettings"}}


def test_every_setting_is_declared_in_one_group():
    declared = {}
    for g in groups():
        for name in g.__dict__["__annotations__"]:
            declared.setdefault(name, set()).add(g.__name__)
    twice = {k: v for k, v in declared.items() if len(v) > 1 and HOMONYMS.get(k) != v}
    assert not twice, f"declared in two groups: {twice}"
    for cls in COMMANDS.values():           # a command composing both would silently take one of them
        for name, owners in HOMONYMS.items():
            assert len(owners & {c.__name__ for c in cls.GROUPS}) <= 1, f"{cls.__name__} composes two {name}"


def test_every_setting_a_flag_has_its_help():
    for g in groups():
        for f in dataclasses.fields(g):
            assert f.metadata.get("help", "").strip(), f"{g.__name__}.{f.name}: no help"


def test_a_command_class_composes_groups_and_declares_nothing():
    """A command's settings are its groups' fields; its FLAGS are among those groups."""
    for cmd, cls in COMMANDS.items():
        assert not cls.__dict__.get("__annotations__"), f"{cls.__name__} declares a field of its own"
        groups_of = [g.group if isinstance(g, settings.Some) else g for g in cls.FLAGS]
        assert all(g in cls.GROUPS for g in groups_of), f"{cmd}: a FLAGS group it does not compose"


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_flag_is_a_field_and_every_field_of_its_groups_a_flag(cmd):
    cls = COMMANDS[cmd]
    sub = next(a for a in run.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    dests = {a.dest for a in sub._actions}
    fields = {f.name for f in settings.flags(cls)}
    assert fields <= dests, f"{cmd}: settings without a flag: {sorted(fields - dests)}"
    extra = sorted(dests - fields - COMMAND_OPTIONS)
    assert not extra, f"{cmd}: flags that are no setting: {extra}"
    for a in sub._actions:                     # a setting's flag is spelled as its field, '_' as '-'
        if a.dest in fields:
            assert "--" + a.dest.replace("_", "-") in a.option_strings


def test_a_secret_setting_stays_out_of_the_settings_repr():
    cfg = settings.ServeConfig(api_key="S3cret-key")
    assert cfg.serve.api_key == "S3cret-key" and "S3cret" not in repr(cfg) and "api_key" not in repr(cfg)


def test_a_secret_setting_stays_out_of_the_record():
    import runs
    cfg = settings.ServeConfig(api_key="S3cret-key")
    assert "api_key" not in runs.printable(cfg) and "port" in runs.printable(cfg)


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_a_commands_own_default_is_for_one_of_its_flags_and_said_in_its_help(cmd):
    """A command may give a setting of its groups a default of its own (settings.Default): bench-audit's
    float32, export's dtype of the run or checkpoint, bench's compile when a compiler is found."""
    import runs
    cls = COMMANDS[cmd]
    sub = next(a for a in run.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    helps = {a.dest: a.help for a in sub._actions}
    required = {f.name: (f.metadata["choices"] or ("x",))[0] for f in settings.flags(cls) if f.metadata["required"]}
    for name, d in settings.own_defaults(cls).items():
        assert name in {f.name for f in settings.flags(cls)} and f"default here: {d.says}" in helps[name]
        assert runs.resolve(cls, required, from_record=False).flat()[name] == d.value


def test_no_group_inherits_another():
    """Groups compose in a command's class, never by extending one another (each group's only base is
    Settings)."""
    for g in groups():
        assert g.__bases__ == (settings.Settings,), g


def test_a_comma_list_is_parsed_once_and_printed_as_given():
    cfg = settings.EvalConfig(conditions="Non-Defense, GEO Defender", seen_methods="GEO,AutoGEO",
                              transfer="gpt=a/lib.json")
    e = cfg.eval
    assert e.conditions == ("Non-Defense", "GEO Defender") and str(e.conditions) == "Non-Defense,GEO Defender"
    assert cfg.seen.seen_methods == ("GEO", "AutoGEO") and e.transfer[0] == settings.Transfer("gpt", "a/lib.json")
    assert settings.EvalConfig(conditions="paper").eval.conditions == "paper"         # a word stays the word
    assert settings.EvalConfig(conditions="paper ").eval.conditions == "paper"        # typed with a space or comma
    assert settings.EvalConfig(conditions=" all,").eval.conditions == "all"
    assert cfg.replace(seed=1).eval.conditions == e.conditions                      # parsed once: kept as it is
    assert settings.AttackConfig(budgets="16,1,4").attack.budgets == (1, 4, 16)
    assert str(settings.HardenConfig().harden.eval_budgets) == "1,4,16"


@pytest.mark.parametrize("kw,msg", [({"budgets": "1,x"}, "--budgets '1,x': a comma list of positive integers"),
                                    ({"budgets": "0,4"}, "--budgets '0,4'"), ({"methods": " , "}, "--methods"),
                                    ({"transfer": "a b=x.json"}, "--transfer 'a b=x.json': give name=path"),
                                    # counted twice / two libraries writing one results file
                                    ({"methods": "GEO,MAGEO,GEO"}, "--methods 'GEO,MAGEO,GEO': GEO given more than"),
                                    ({"transfer": "a=x.json,a=y.json"}, "--transfer 'a=x.json,a=y.json': a given"),
                                    ({"seen_methods": "MAGEO,MAGEO"}, "--seen-methods 'MAGEO,MAGEO': MAGEO given"),
                                    ({"conditions": "paper,paper"}, "--conditions 'paper,paper': paper given")])
def test_a_bad_comma_list_is_refused_naming_its_flag(kw, msg):
    with pytest.raises(settings.SettingsError, match=msg.replace("(", r"\(")):
        settings.AttackConfig(**kw)


@pytest.mark.parametrize("argv", [["demo", "--out", ""], ["train", "--runs-dir", " ", "--dry-run"],
                                  ["build-bench", "--input", "x.jsonl", "--output", ""],
                                  ["compare", "--runs", "a,b", "--out", ""]])
def test_an_empty_path_is_refused_not_taken_for_the_current_folder(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        run.main(argv)
    assert not os.listdir(tmp_path)


def test_the_offline_engine_under_any_model_name_serves_its_batch_api():
    """--llm offline:NAME --batch-api on goes through the offline engine's batch API, as --llm offline does (the
    engine is one, whatever name the spec gives it)."""
    assert settings.LLMSettings(llm="offline:any", batch_api="on").offline_batches
    assert not settings.LLMSettings(llm="ollama:offline", batch_api="on").offline_batches
