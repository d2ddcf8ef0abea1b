"""``sgl-kvtier launch``: the command it builds, and configs that fail before SGLang starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_kvtier.cli import main
from sgl_kvtier.config import StoreConfig
from sgl_kvtier.errors import ConfigError
from sgl_kvtier.policy.cost_inputs import ENV_POLICY
from sgl_kvtier.serving.launch import Offload, build_command, load, sglang_args

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def extra_of(cmd):
    return json.loads(cmd[cmd.index("--hicache-storage-backend-extra-config") + 1])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    doc = load(path)
    cmd, env = build_command(doc, [], gpu=True, make_model=False)
    extra = extra_of(cmd)
    assert extra["class_name"] == "KVTierStorage" and extra["interface_v1"] == 1
    StoreConfig.from_mapping({k: v for k, v in extra.items() if k in doc["kvtier"]})
    assert "--enable-hierarchical-cache" in cmd and cmd[cmd.index("--hicache-storage-backend") + 1] == "dynamic"
    policy = doc["kvtier"].get("prefetch_policy")
    assert "prefetch_policy" not in extra and env == ({ENV_POLICY: policy} if policy else {})
    for line in path.read_text().splitlines():  # every setting carries a comment
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}: uncommented line {line!r}"



@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_config_opens_with_when_to_pick_it_and_the_flags_it_needs(path):
    """The header's first line says when to pick the file; the flags it lists are the ones the launch
    command sets, its host layout included."""
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# Pick this "), lines[0]
    header = " ".join(line.lstrip("#").strip() for line in lines[:lines.index("[sglang]")])
    cmd, _ = build_command(load(path), [], gpu=True, make_model=False)
    extra = extra_of(cmd)
    assert extra["hicache_storage_pass_prefix_keys"] is True and extra["interface_v1"] == 1
    for flag in ("--enable-hierarchical-cache", "--hicache-storage-backend dynamic",
                 '"hicache_storage_pass_prefix_keys": true', '"interface_v1": 1',
                 f"--hicache-mem-layout {cmd[cmd.index('--hicache-mem-layout') + 1]}",
                 f"--hicache-io-backend {cmd[cmd.index('--hicache-io-backend') + 1]}"):
        assert flag in header, f"{path.name}: {flag} not in its header"

def test_expected_configs_exist():
    assert {p.name for p in CONFIGS} >= {"cpu-demo.toml", "nvme-local.toml", "nvmeof-4ns.toml",
                                          "qwen3-coder-480b-tp8.toml", "shared-host.toml", "shared-nfs.toml",
                                          "raw-shared.toml"}


def test_the_shared_host_example_launches_two_servers_on_one_pool():
    """Both command lines of its comment: one store, one pool-wide cap, sharing on."""
    path = ROOT / "configs" / "shared-host.toml"
    text = path.read_text()
    cmds = [line.split("#", 1)[1].strip() for line in text.splitlines() if "sgl-kvtier launch" in line]
    assert len(cmds) == 2 and len({c.split(" -- ", 1)[1] for c in cmds}) == 2  # ports / GPUs differ
    doc = load(path)
    extras = [extra_of(build_command(doc, c.split(" -- ", 1)[1].split(), gpu=True, make_model=False)[0]) for c in cmds]
    assert extras[0] == extras[1] and extras[0]["sharing"] == "host" and extras[0]["capacity_bytes"] > 0

def test_the_shared_nfs_example_runs_cluster_mode_with_direct_io():
    """Both command lines of its comment give one store in cluster mode with O_DIRECT; the deployment
    guide for several hosts on a shared filesystem starts from it."""
    path = ROOT / "configs" / "shared-nfs.toml"
    cmds = [line.split("$ ", 1)[1].strip() for line in path.read_text().splitlines() if "$ sgl-kvtier launch" in line]
    assert len(cmds) == 2
    doc = load(path)
    extras = [extra_of(build_command(doc, c.split(" -- ", 1)[1].split(), gpu=True, make_model=False)[0]) for c in cmds]
    assert extras[0] == extras[1]
    assert extras[0]["sharing"] == "cluster" and extras[0]["direct_io"] == "on" and not extras[0].get("allow_local_fs")
    guide = (ROOT / "docs" / "deploy" / "several-hosts.md").read_text()
    assert "configs/shared-nfs.toml" in guide and "shared-raw.md" in guide


def test_the_raw_shared_example_is_a_host_slot_of_a_shared_raw_pool():
    """Its command line gives cluster mode on a raw namespace with this host's host_index, O_DIRECT and no
    meta_dir; its comment formats the namespace once, as the shared raw deployment guide does."""
    path = ROOT / "configs" / "raw-shared.toml"
    text = path.read_text()
    assert "sgl-kvtier pool-format /dev/nvme1n1 --hosts 2 --yes" in text
    extra = extra_of(build_command(load(path), ["--port", "30000"], gpu=True, make_model=False)[0])
    assert extra["sharing"] == "cluster" and extra["host_index"] == 0 and extra["direct_io"] == "on"
    assert "meta_dir" not in extra and extra["devices"] == ["/dev/nvme1n1"]
    guide = (ROOT / "docs" / "deploy" / "shared-raw.md").read_text()
    assert "configs/raw-shared.toml" in guide and "pool-format /dev/nvme1n1 --hosts 2 --yes" in guide


def test_cpu_flags_and_flag_spelling(tmp_path):
    doc = {"sglang": {"model_path": "/m", "page_size": 16, "enable_cache_report": True, "enable_metrics": False,
                      "prefetch_threshold": 128},
           "kvtier": {"devices": ["rel-dir"], "capacity_bytes": 1 << 30}}
    cmd, env = build_command(doc, ["--port", "1"], gpu=False, make_model=False)
    assert env == {"KVTIER_CPU_SHIMS": "1"}
    assert cmd[cmd.index("--page-size") + 1] == "16" and "--enable-cache-report" in cmd
    assert "--enable-metrics" not in cmd and "--device" in cmd and cmd[-2:] == ["--port", "1"]
    extra = extra_of(cmd)
    assert extra["prefetch_threshold"] == 128 and Path(extra["devices"][0]).is_absolute()


def test_bad_kvtier_key_fails_before_launch(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[sglang]\nmodel_path = "/m"\n[kvtier]\ndevices = ["/x"]\ncapacity_bytes = "huge"\n')
    assert main(["launch", "--config", str(cfg), "--print"]) == 1
    assert "capacity_bytes" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="^devices"):
        build_command({"sglang": {"model_path": "/m"}, "kvtier": {}}, [], gpu=True, make_model=False)
    cfg.write_text('[sglang]\nmodel_path = "/m"\n[kvtierr]\n')
    with pytest.raises(ConfigError, match="kvtierr"):
        load(cfg)


def test_prefetch_policy_becomes_the_servers_environment(tmp_path, capsys):
    def launch(kvtier_extra, gpu=True):
        doc = {"sglang": {"model_path": "/m"}, "kvtier": {"devices": ["/x"], **kvtier_extra}}
        cmd, env = build_command(doc, [], gpu=gpu, make_model=False)
        assert "prefetch_policy" not in extra_of(cmd)  # a launch setting, never a store key
        return env

    assert launch({}) == {}  # default: nothing set, the policy stays off
    assert launch({"prefetch_policy": "cost"}) == {ENV_POLICY: "cost"}
    assert launch({"prefetch_policy": "off"}) == {ENV_POLICY: "off"}  # the file wins over an inherited value
    assert launch({"prefetch_policy": "cost"}, gpu=False) == {ENV_POLICY: "cost", "KVTIER_CPU_SHIMS": "1"}
    for bad in ("Cost", "on", "", True, 1):
        with pytest.raises(ConfigError, match=r"^kvtier\.prefetch_policy: ") as err:
            launch({"prefetch_policy": bad})
        assert err.value.field == "kvtier.prefetch_policy"
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[sglang]\nmodel_path = "/m"\n[kvtier]\ndevices = ["/x"]\nprefetch_policy = "fast"\n')
    assert main(["launch", "--config", str(cfg), "--print"]) == 1  # fails before anything is launched
    out = capsys.readouterr().out
    assert "kvtier.prefetch_policy" in out and "sglang.launch_server" not in out
    cfg.write_text('[sglang]\nmodel_path = "/m"\n[kvtier]\ndevices = ["/x"]\nprefetch_policy = "cost"\n')
    assert main(["launch", "--config", str(cfg), "--print"]) == 0
    assert capsys.readouterr().out.startswith(f"{ENV_POLICY}=cost ")


def test_print_shows_the_command(tmp_path, capsys):
    cfg = tmp_path / "ok.toml"
    cfg.write_text('[sglang]\nmodel_path = "/m"\n[kvtier]\ndevices = ["/x"]\n')
    assert main(["launch", "--config", str(cfg), "--print"]) == 0
    out = capsys.readouterr().out
    assert "sglang.launch_server" in out and '"devices": ["/x"]' in out


def test_demo_default_matches_the_shipped_cpu_config():
    from sgl_kvtier.serving.demo import DEMO_CONFIG

    shipped = load(ROOT / "configs" / "cpu-demo.toml")
    assert shipped["kvtier"] == DEMO_CONFIG["kvtier"]
    assert shipped["sglang"] == DEMO_CONFIG["sglang"]


def test_a_model_size_is_served_in_the_chosen_dtype(tmp_path, monkeypatch):
    """``model_path = "tiny"``: a factory model in the machine's native dtype (or the forced one), in a cache
    directory of its own per dtype, and ``--dtype`` spelled out (SGLang's auto would make float32 float16)."""
    from sgl_kvtier.serving.hardware import ENV_DTYPE, native_dtype

    monkeypatch.setenv("KVTIER_MODEL_CACHE", str(tmp_path))
    monkeypatch.delenv(ENV_DTYPE, raising=False)

    def launch(gpu=False, **sglang):
        doc = {"sglang": {"model_path": "tiny", **sglang}, "kvtier": {"devices": ["/x"]}}
        cmd, _ = build_command(doc, [], gpu=gpu, make_model=False)
        assert cmd.count("--dtype") == 1
        return Path(cmd[cmd.index("--model-path") + 1]), cmd[cmd.index("--dtype") + 1]

    assert launch() == (tmp_path / f"tiny-{native_dtype()}", native_dtype())
    assert launch(gpu=True) == (tmp_path / "tiny-bfloat16", "bfloat16")  # a GPU keeps bf16
    assert launch(dtype="float32") == (tmp_path / "tiny-float32", "float32")
    assert launch(dtype="auto") == launch()
    monkeypatch.setenv(ENV_DTYPE, "float32")
    assert launch(gpu=True) == (tmp_path / "tiny-float32", "float32")
    assert launch(dtype="bfloat16") == (tmp_path / "tiny-bfloat16", "bfloat16")  # the config file wins
    with pytest.raises(ConfigError, match=r"^sglang\.dtype: "):
        launch(dtype="half")
    cmd, _ = build_command({"sglang": {"model_path": "/m"}, "kvtier": {"devices": ["/x"]}}, [], gpu=False,
                           make_model=False)
    assert "--dtype" not in cmd  # a model path is SGLang's to read


def test_the_demo_serves_its_model_in_the_chosen_dtype(tmp_path, monkeypatch):
    from sgl_kvtier.serving import demo
    from sgl_kvtier.serving.hardware import ENV_DTYPE

    monkeypatch.setenv("KVTIER_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(ENV_DTYPE, "float32")
    model, args = demo.server_args(tmp_path / "flash", gpu=False)
    assert model == tmp_path / "cache" / "tiny-float32" and json.loads((model / "config.json").read_text())["dtype"] \
        == "float32"
    assert args[args.index("--dtype") + 1] == "float32" and args[-1] == "--skip-server-warmup"
    assert extra_of(args)["devices"] == [str(tmp_path / "flash")] and "--device" not in args  # SGLangServer adds it


def test_offload_levels_below_l3_leave_their_tiers_out():
    doc = load(ROOT / "configs" / "cpu-demo.toml")
    doc["sglang"]["model_path"] = "/models/m"
    doc["kvtier"]["streaming"] = "on"
    _, l3, l3_env = sglang_args(doc, gpu=True)
    _, l2, l2_env = sglang_args(doc, gpu=True, offload=Offload.L2_ONLY)
    _, hbm, hbm_env = sglang_args(doc, gpu=True, offload=Offload.HBM_ONLY)
    assert "--hicache-storage-backend" in l3 and l3_env
    assert "--enable-hierarchical-cache" in l2 and l2_env == {} and hbm_env == {}
    assert not [a for a in l2 if a.startswith("--hicache-storage")] and "--hicache-ratio" in l2
    assert not [a for a in hbm if a.startswith(("--hicache", "--enable-hierarchical-cache"))]
    common = [a for a in l3 if not a.startswith(("--hicache", "--enable-hierarchical"))]
    assert "--page-size" in common and "--max-total-tokens" in common
    for args in (l2, hbm):  # every flag that is not about the tiers is kept, with its value
        assert "--enable-metrics" in args
        for flag in ("--page-size", "--max-total-tokens"):
            assert args[args.index(flag) + 1] == l3[l3.index(flag) + 1]
