"""Tests for configure(): --key=value parsing, type checks, config files, and the error messages."""

import pytest

from configurator import configure
from gpt import UserError

DEFAULTS = dict(
    out_dir="out",
    batch_size=12,
    max_iters=5000,
    learning_rate=6e-4,
    compile=True,
    prompt="\n",
    top_k=None,
    betas=(0.9, 0.95),
    layers=[1, 2],
)


def run(*argv):
    return configure(DEFAULTS, list(argv))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_no_arguments_gives_an_equal_copy():
    settings = run()
    assert settings == DEFAULTS and settings is not DEFAULTS


@pytest.mark.parametrize(
    "arg, key, expected",
    [
        ("--batch_size=32", "batch_size", 32),
        ("--learning_rate=3e-4", "learning_rate", 3e-4),
        ("--compile=False", "compile", False),
        ("--out_dir='my dir'", "out_dir", "my dir"),  # quoted string
        ('--out_dir="x"', "out_dir", "x"),
        ("--out_dir=out-shakespeare", "out_dir", "out-shakespeare"),  # unquoted string
        ("--top_k=200", "top_k", 200),
        ("--top_k=None", "top_k", None),
        ("--top_k=abc", "top_k", "abc"),  # a None default takes the raw text when it is no literal
        ("--betas=(0.8,0.99)", "betas", (0.8, 0.99)),
        ("--betas=0.8,0.99", "betas", (0.8, 0.99)),
        ("--betas=[0.8,0.99]", "betas", (0.8, 0.99)),  # a list for a tuple default becomes a tuple
        ("--layers=(3,)", "layers", [3]),
        ("--max_iters=1e3", "max_iters", 1000),  # an integral float is fine for an int
        ("--max-iters=7", "max_iters", 7),  # dashes in the key, as argparse users type them
    ],
)
def test_key_equals_value(arg, key, expected):
    settings = run(arg)
    assert settings[key] == expected and type(settings[key]) is type(expected)
    assert {k: v for k, v in settings.items() if k != key} == {k: v for k, v in DEFAULTS.items() if k != key}


def test_value_may_contain_equals_signs():
    assert run("--prompt=a=b=c")["prompt"] == "a=b=c"
    assert run("--out_dir", "x=1")["out_dir"] == "x=1"


def test_str_setting_keeps_the_raw_text_of_non_string_literals():
    assert run("--out_dir=123")["out_dir"] == "123"
    assert run("--prompt=1+1")["prompt"] == "1+1"
    assert run("--prompt=True")["prompt"] == "True"
    assert run("--prompt=")["prompt"] == ""


def test_int_is_accepted_for_a_float_and_stored_as_float():
    value = run("--learning_rate=1")["learning_rate"]
    assert value == 1.0 and type(value) is float


@pytest.mark.parametrize(
    "word, expected",
    [("True", True), ("true", True), ("TRUE", True), ("1", True)]
    + [("False", False), ("false", False), ("FALSE", False), ("0", False)],
)
def test_bool_words(word, expected):
    assert run(f"--compile={word}")["compile"] is expected
    assert run("--compile", word)["compile"] is expected
    assert configure(dict(DEFAULTS, compile=not expected), [f"--compile={word}"])["compile"] is expected


def test_key_space_value():
    settings = run("--prompt", "ROMEO:", "--batch_size", "8", "--learning_rate", "-1e-3")
    assert (settings["prompt"], settings["batch_size"], settings["learning_rate"]) == ("ROMEO:", 8, -1e-3)


def test_bare_bool_flag_sets_true():
    off = dict(DEFAULTS, compile=False)
    assert configure(off, ["--compile"])["compile"] is True
    assert configure(off, ["--compile", "--batch_size=3"]) == dict(off, compile=True, batch_size=3)


def test_bool_flag_followed_by_a_config_file_leaves_the_file_positional(tmp_path):
    path = write(tmp_path, "x.py", "batch_size = 64\n")
    settings = configure(dict(DEFAULTS, compile=False), ["--compile", path])
    assert settings["compile"] is True and settings["batch_size"] == 64


def test_non_bool_key_without_value_is_an_error():
    with pytest.raises(UserError, match="--batch_size needs a value"):
        run("--batch_size")
    with pytest.raises(UserError, match="--out_dir needs a value"):
        run("--out_dir", "--compile")


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--batch_size=abc", "--batch_size: expected an int, got 'abc'"),
        ("--batch_size=3.5", "--batch_size: expected an int, got '3.5'"),
        ("--batch_size=True", "--batch_size: expected an int, got 'True'"),
        ("--learning_rate=abc", "--learning_rate: expected a float, got 'abc'"),
        ("--learning_rate=False", "--learning_rate: expected a float, got 'False'"),
        ("--compile=maybe", "--compile: expected True or False, got 'maybe'"),
        ("--compile=2", "--compile: expected True or False, got '2'"),
        ("--betas=0.9", "--betas: expected a tuple, got '0.9'"),
    ],
)
def test_wrong_type_is_an_error_naming_the_key(arg, expected):
    with pytest.raises(UserError) as info:
        run(arg)
    assert str(info.value) == expected


def test_unknown_key_suggests_the_closest_known_key():
    with pytest.raises(UserError) as info:
        run("--learning_rat=1e-3")
    assert str(info.value) == "unknown setting 'learning_rat' (did you mean 'learning_rate'?)"
    with pytest.raises(UserError) as info:
        run("--zzzz=1")
    assert str(info.value) == "unknown setting 'zzzz'"  # no hint when nothing is close


def test_config_file_applies_settings_and_later_cli_overrides_win(tmp_path):
    path = write(
        tmp_path,
        "small.py",
        "import math\n"
        "_scale = 2\n"
        "def helper(): pass\n"
        "batch_size = 16 * _scale\n"
        "learning_rate = 1e-3\n"
        "max_iters = int(math.sqrt(100))\n"
        "out_dir = 'out-small'\n",
    )
    settings = run(path, "--learning_rate=5e-4")
    assert settings == dict(DEFAULTS, batch_size=32, learning_rate=5e-4, max_iters=10, out_dir="out-small")
    assert run("--learning_rate=5e-4", path)["learning_rate"] == 1e-3  # order matters both ways


def test_two_config_files_apply_in_order(tmp_path):
    first = write(tmp_path, "a.py", "batch_size = 1\nmax_iters = 10\n")
    second = write(tmp_path, "b.py", "batch_size = 2\n")
    assert run(first, second) == dict(DEFAULTS, batch_size=2, max_iters=10)
    assert run(second, first) == dict(DEFAULTS, batch_size=1, max_iters=10)


def test_config_file_values_are_type_checked(tmp_path):
    path = write(tmp_path, "bad.py", "learning_rate = 'fast'\n")
    with pytest.raises(UserError, match=r"bad\.py: learning_rate: expected a float, got 'fast'"):
        run(path)
    path = write(tmp_path, "ok.py", "learning_rate = 1\ncompile = 0\n")
    settings = run(path)
    assert type(settings["learning_rate"]) is float and settings["compile"] is False


def test_unknown_key_in_config_file_names_the_file_and_suggests(tmp_path):
    path = write(tmp_path, "typo.py", "batchsize = 4\n")
    with pytest.raises(UserError) as info:
        run(path)
    assert str(info.value) == f"{path}: unknown setting 'batchsize' (did you mean 'batch_size'?)"


def test_missing_config_file_is_named_and_a_close_one_suggested(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "small.py").write_text("")
    with pytest.raises(UserError) as info:
        run("config/smal.py")
    message = str(info.value)
    assert "'config/smal.py'" in message and "(did you mean 'config/small.py'?)" in message
    with pytest.raises(UserError, match="'nothing_like_it.txt'") as info:
        run("nothing_like_it.txt")
    assert "did you mean" not in str(info.value)
    # a setting without its dashes, read as a file's name: said as the setting
    with pytest.raises(UserError, match=r"^cannot read config file 'max_iters=10': No such file or directory; a "
                                        r"setting takes two dashes: --max_iters=10$"):
        run("max_iters=10")


def test_config_file_with_a_syntax_error(tmp_path):
    path = write(tmp_path, "broken.py", "batch_size = 4\nlearning_rate = = 1\n")
    with pytest.raises(UserError) as info:
        run(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2: SyntaxError") and "\n" not in message


def test_config_file_that_raises_reports_its_line(tmp_path):
    path = write(tmp_path, "raises.py", "batch_size = 4\n\nmax_iters = int('many')\n")
    with pytest.raises(UserError) as info:
        run(path)
    assert str(info.value) == f"{path}, line 3: ValueError: invalid literal for int() with base 10: 'many'"


def test_config_file_error_inside_its_own_function_reports_the_innermost_line(tmp_path):
    path = write(tmp_path, "nested.py", "def _size():\n    return 1 // 0\n\nbatch_size = _size()\n")
    with pytest.raises(UserError) as info:
        run(path)
    assert str(info.value) == f"{path}, line 2: ZeroDivisionError: integer division or modulo by zero"


def test_defaults_are_not_mutated(tmp_path):
    defaults = dict(DEFAULTS, layers=[1, 2])
    snapshot = dict(defaults)
    path = write(tmp_path, "c.py", "batch_size = 99\n")
    settings = configure(defaults, [path, "--compile=False", "--layers=[5]"])
    assert defaults == snapshot and defaults["layers"] == [1, 2]
    assert settings["batch_size"] == 99 and settings["layers"] == [5]


# nanoGPT's names: its users' habits get the setting or config file that does that here, not the nearest spelling


@pytest.mark.parametrize("argv, hint", [(["--start=ROMEO"], "did you mean 'prompt'?"),
                                        (["--decay_lr=False"], "did you mean 'lr_schedule'?"),
                                        (["config/train_shakespeare_char.py"], "did you mean 'config/small.py'?")])
def test_nanogpts_names_get_ours_suggested(monkeypatch, argv, hint):
    import os

    import sample
    import train
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where config/ is
    defaults = sample.DEFAULTS if argv[0].startswith("--start") else train.DEFAULTS
    with pytest.raises(UserError) as error:
        configure(defaults, argv)
    assert str(error.value).endswith(f"({hint})"), error.value


def test_init_from_gpt2_says_what_hf_loads_instead():
    import train
    with pytest.raises(UserError, match=r"got 'gpt2'; GPT-2's own weights are another architecture .*hf: loads a "
                                        r"Llama or Qwen3 folder"):
        train.check_settings(dict(train.DEFAULTS, init_from="gpt2"))


@pytest.mark.parametrize("config", ["config/small.py", "config/shakespeare_bpe.py", "config/small_draft.py",
                                    "config/gpt2_124m.py"])
def test_each_configs_schedule_follows_max_iters(monkeypatch, config):
    """--max_iters=N on a config ends its learning-rate decay at N: a config that pinned lr_decay_iters left a shorter
    run undecayed, and a longer one at min_lr for every iteration past the pin."""
    import os

    import train
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for max_iters in (800, 30000):  # past every warmup
        settings = configure(train.DEFAULTS, [config, f"--max_iters={max_iters}"])
        min_ratio = settings["min_lr"] / settings["learning_rate"]
        assert train.lr_multiplier(max_iters - 1, settings) > min_ratio  # still decaying
        assert train.lr_multiplier(max_iters, settings) == min_ratio
