"""The learned prior end to end on a micro latent decoder: stage-2 posteriors on disk (exact resumption, settings,
standardisation), the DiT's training (exact resumption), sampling through the API and the CLI, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from conftest import CLASSIC_LATENT, micro_config
from ltm_jax import cli
from ltm_jax import model as model_lib
from ltm_jax.api import load
from ltm_jax.config import LatentConfig, validate
from ltm_jax.errors import ConfigError, LtmError, WorkdirError
from ltm_jax.prior import posteriors
from ltm_jax.prior.model import load_prior
from ltm_jax.prior.train import train_prior
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train.optimizer import make_optimizer
from ltm_jax.train.step import create_train_state

PRIOR = ["prior.width=32", "prior.depth=1", "prior.n_heads=2", "prior.batch_size=8", "prior.steps=6",
         "prior.log_every=3", "prior.checkpoint_every=3", "prior.warmup_steps=2", "prior.sampler_steps=3"]
COLLECT = dict(sequences=20, heldout_fraction=0.2, batch_size=4, shard_size=8)


def _decoder_workdir(path, n_per_layer=2, latents=True):
  """A workdir holding a freshly initialised latent decoder at step 0 (training it is not what is tested here); z is
  read by the top block of two only, so z's shape is not the model's layer count."""
  cfg = micro_config(layer_pattern="A", n_layers=2)
  cfg = validate(dataclasses.replace(cfg, latent=LatentConfig(**{**CLASSIC_LATENT, "enabled": latents, "top_layers": 1},
                                                                n_per_layer=n_per_layer, inner_steps=2)))
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(1), cfg.latent),
                             make_optimizer(cfg.train), 0)
  checkpointer = ckpt_lib.Checkpointer(path, keep=1, async_save=False)
  checkpointer.save(0, state, {}, cfg)
  checkpointer.close()
  ckpt_lib.write_config_json(path, cfg)
  return path


def _files(folder) -> dict:
  return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A decoder with its posteriors collected and a prior trained for 6 steps."""
  path = _decoder_workdir(tmp_path_factory.mktemp("prior") / "w")
  posteriors.collect(load(path), path, **COLLECT)
  train_prior(path, PRIOR, log=lambda _: None)
  return path


def test_posteriors_are_stored_with_their_aggregate_moments(workdir):
  collected = posteriors.PosteriorSet(posteriors.folder_of(workdir))
  assert collected.num_records == 20 and collected.num_train == 16 and collected.latent_shape == (1, 2, 32)
  records = collected.read(range(collected.num_records)).astype(np.float64)
  z, mu, logvar = records[:, 0], records[:, 1], records[:, 2]
  assert np.all(np.isfinite(records)) and np.all(logvar < 0)
  # z is a draw from each posterior: its standardised residual is standard normal (2560 values: mean and std to 0.1).
  residual = (z - mu) / np.exp(0.5 * logvar)
  assert abs(residual.mean()) < 0.1 and abs(residual.std() - 1) < 0.1
  train = slice(0, 16)  # The held-out records do not enter the standardisation.
  mean = mu[train].mean(0)
  var = ((mu[train] - mean) ** 2).mean(0) + np.exp(logvar[train]).mean(0)
  np.testing.assert_allclose(collected.mean, mean, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(collected.std, np.sqrt(var), rtol=1e-5)
  np.testing.assert_array_equal(collected.heldout(), records[16:].astype(np.float32))


def test_collection_resumes_exactly_after_an_interruption(workdir, tmp_path):
  interrupted = _decoder_workdir(tmp_path / "w")

  def stop_after_first(done, total):
    if done == 1:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    posteriors.collect(load(interrupted), interrupted, **COLLECT, on_shard=stop_after_first)
  folder = posteriors.folder_of(interrupted)
  assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "shard-00000.array_record"]
  with pytest.raises(LtmError, match="incomplete"):
    posteriors.PosteriorSet(folder)
  posteriors.collect(load(interrupted), interrupted, **COLLECT)
  assert _files(folder) == _files(posteriors.folder_of(workdir))


def test_collection_refuses_other_settings_and_changes_nothing(workdir):
  folder = posteriors.folder_of(workdir)
  before = _files(folder)
  with pytest.raises(LtmError, match="other settings: sequences 20"):
    posteriors.collect(load(workdir), workdir, **{**COLLECT, "sequences": 12})
  # The decoder's overrides are settings too: another inner learning rate fits other posteriors.
  with pytest.raises(LtmError, match=r"other settings: latent.inner_lr \S+ \(now 0.9\)"):
    posteriors.collect(load(workdir, overrides=["latent.inner_lr=0.9"]), workdir, **COLLECT)
  assert _files(folder) == before


def test_a_manifest_without_a_newer_key_reads_it_as_its_default_and_an_older_layout_is_named(workdir, tmp_path):
  other = tmp_path / "w"
  shutil.copytree(workdir, other)
  path = posteriors.folder_of(other) / posteriors.MANIFEST
  manifest = json.loads(path.read_text())
  assert manifest.pop("latent.init_logvar") == LatentConfig().init_logvar  # As if the key were added later.
  path.write_text(json.dumps(manifest))
  assert posteriors.collect(load(other), other, **COLLECT) == posteriors.folder_of(other)
  manifest["inner_steps"] = manifest.pop("latent.inner_steps")  # The layout that recorded the step count alone.
  path.write_text(json.dumps(manifest))
  with pytest.raises(LtmError, match="collected by an earlier ltm_jax that did not record the decoder's latent"):
    posteriors.collect(load(other), other, **COLLECT)


def test_prior_training_resumes_exactly(workdir, tmp_path):
  other = tmp_path / "w"
  shutil.copytree(workdir, other, ignore=shutil.ignore_patterns("checkpoints", "metrics.jsonl", "tensorboard",
                                                               "*.lock"))
  shutil.copytree(workdir / "checkpoints", other / "checkpoints")  # The decoder's, not the prior's.
  train_prior(other, [p for p in PRIOR if "steps=6" not in p] + ["prior.steps=3"], log=lambda _: None)
  result = train_prior(other, ["prior.steps=6"], log=lambda _: None)  # The other keys come from the checkpoint.
  assert result.step == 6
  resumed, straight = load_prior(other, load(other).config), load_prior(workdir, load(workdir).config)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, straight.params)
  assert resumed.step == straight.step == 6


def test_a_prior_whose_checkpoints_are_gone_is_refused_and_nothing_is_written(workdir, tmp_path):
  other = tmp_path / "w"
  shutil.copytree(workdir, other)
  shutil.rmtree(other / "prior" / "checkpoints")
  before = _files(other)
  with pytest.raises(WorkdirError, match=r"prior holds no checkpoint, but its metrics.jsonl logs training up to step "
                                         r"6; to start over, delete \S+/prior/metrics.jsonl and \S+/prior/tensorboard "
                                         r"\(the posteriors in \S+ stay\)"):
    train_prior(other, PRIOR, log=lambda _: None)
  assert _files(other) == before and not (other / "prior" / "checkpoints").exists()
  for name in ("metrics.jsonl", "tensorboard"):  # As the advice says.
    shutil.rmtree(other / "prior" / name) if name == "tensorboard" else (other / "prior" / name).unlink()
  before = _files(other)  # A refused new prior writes nothing either.
  with pytest.raises(ConfigError, match="prior.batch_size=100 exceeds the 16 training posteriors"):
    train_prior(other, PRIOR + ["prior.batch_size=100"], log=lambda _: None)
  assert _files(other) == before and not (other / "prior" / "checkpoints").exists()


def test_a_damaged_newest_prior_checkpoint_falls_back_and_a_refused_resume_moves_nothing(workdir, tmp_path):
  other = tmp_path / "w"
  shutil.copytree(workdir, other)
  (other / "prior" / "checkpoints" / "6" / "config" / "metadata").write_text("{not json")
  before = _files(other)
  with pytest.raises(ConfigError, match=r"prior.steps=2 is below the prior checkpoint resumed from \(step 3\)"):
    train_prior(other, ["prior.steps=2"], log=lambda _: None)
  assert _files(other) == before
  said = []
  assert train_prior(other, ["prior.steps=6"], log=said.append).step == 6
  assert said[0] == f"warning: moved unreadable checkpoint(s) [6] to {other / 'prior' / 'damaged-checkpoints'}"
  assert said[1] == "resuming the prior from step 3"
  resumed, straight = load_prior(other, load(other).config), load_prior(workdir, load(workdir).config)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, straight.params)


def test_a_prior_is_not_resumed_on_posteriors_collected_again(workdir, tmp_path):
  other = tmp_path / "w"
  shutil.copytree(workdir, other)
  shutil.rmtree(posteriors.folder_of(other))
  posteriors.collect(load(other), other, **{**COLLECT, "seed": 1})  # As many records, of the same decoder step.
  before = _files(other)
  with pytest.raises(LtmError, match="was trained on other posteriors than .* holds now"):
    train_prior(other, ["prior.steps=9"], log=lambda _: None)
  assert _files(other) == before


def test_dit_latents_through_the_api(workdir):
  lm = load(workdir)
  z = lm.dit_latents(3, seed=0, sampler="ddpm", steps=4)
  assert z.shape == (3, 1, 2, 32) and np.all(np.isfinite(z))
  np.testing.assert_array_equal(z, lm.dit_latents(3, seed=0, sampler="ddpm", steps=4))
  assert not np.array_equal(z, lm.dit_latents(3, seed=1, sampler="ddpm", steps=4))
  ids = lm.generate_tokens([[72, 101], [65]], 4, key=jax.random.key(0), latents="dit")
  assert ids.shape == (2, 4)
  # dit_latents(seed) with the prior's defaults is the z generate(latents="dit", seed) draws (the CLI's --latents
  # dit draws it so), from the half of the key that token sampling does not use.
  for plan, draw in (("dit", lm.dit_latents), ("prior", lm.prior_latents)):
    drawn = lm.generate(["Hi", "A"], 6, seed=5, latents=draw(2, seed=5))
    assert drawn == lm.generate(["Hi", "A"], 6, seed=5, latents=plan), plan
  with pytest.raises(ValueError, match="sampler steps must be a positive integer"):
    lm.dit_latents(2, steps=0)
  fresh = load(workdir)
  fresh.workdir = None
  with pytest.raises(LtmError, match="no learned prior"):
    fresh.dit_latents(2)


def _cli(capsys, *argv):
  code = cli.main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_generate_with_the_learned_prior(workdir, capsys):
  code, out, _ = _cli(capsys, "generate", "--workdir", workdir, "--latents", "dit", "--sampler", "dpm++",
                      "--sampler-steps", "3", "--max-new-tokens", "4", "--prompt", "a", "--prompt", "bc")
  assert code == 0 and out.count("--- ") == 2


def test_refusals_are_one_line_and_write_nothing(workdir, tmp_path, capsys):
  def fails(match, *argv):
    before = _files(tmp_path)
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and match in err, err
    assert _files(tmp_path) == before

  plain = _decoder_workdir(tmp_path / "plain", latents=False)
  fails("without latent thoughts", "fit-prior", "--workdir", plain)
  bare = _decoder_workdir(tmp_path / "bare")
  fails("has no trained prior", "generate", "--workdir", bare, "--latents", "dit")
  fails("collected posteriors", "train-prior", "--workdir", bare)
  fails("--sequences must be in", "fit-prior", "--workdir", bare, "--sequences", "10000000")
  # A prior trained for another decoder: its latent shape differs from this decoder's.
  wider = _decoder_workdir(tmp_path / "wider", n_per_layer=3)
  shutil.copytree(workdir / "prior", wider / "prior")
  fails("trained for latents of shape [1, 2, 32]", "generate", "--workdir", wider, "--latents", "dit")
  fails("only prior.* keys", "train-prior", "--workdir", workdir, "train.lr=1")
  fails("--sampler and --sampler-steps", "generate", "--workdir", workdir, "--sampler-steps", "5")
  # The prior samples as it was trained to: a prior.* override on the decoder would be ignored.
  fails("prior.sampler=ddpm: prior.* keys are set when training the prior", "generate", "--workdir", workdir,
        "--latents", "dit", "prior.sampler=ddpm")
  with pytest.raises(LtmError, match=r"the seed must be an integer in \[0, 2\*\*32\), got 4294967296"):
    posteriors.collect(load(bare), bare, **{**COLLECT, "seed": 2**32})
  assert not (bare / "prior").exists()
  for seed in ("-1", str(2**32)):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["fit-prior", "--workdir", str(bare), "--seed", seed])
    assert exit_info.value.code == 2 and f"--seed: must be in [0, 2**32), got {seed}" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["generate", "--workdir", str(workdir), "--latents", "dit", "--sampler-steps", "0"])
  assert exit_info.value.code == 2 and "--sampler-steps: must be >= 1, got 0" in capsys.readouterr().err
