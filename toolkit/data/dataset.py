"""One stage's rows: every source read, the stage's part of the split (by each row's prompt, or the whole
source where it names its part), its train and eval examples, and the blended training order.

A row's id is its position over all sources (the rows of earlier sources, then its index in its own),
so an id names the same row in every stage and in every experience record.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.data.blend import Blend
from toolkit.data.examples import Example, check_fields, example_of
from toolkit.data.sources import read_source
from toolkit.data.split import part_of, uniforms
from toolkit.errors import ConfigError


READ: dict[tuple, tuple[list[list[Example]], list[Example], list[float]]] = {}
"""The examples of the last few stages' data read in this process, by what decides them (the data section,
stage, kind, seed, and each source file's checksum): `run` read a prompt file to check it, the driver
again for its feeder and again for its held-out prompts (29 s, 28 s, 47 s for 1M rows here). Examples are never
changed once made, so they are shared; each StageData has its own cursor."""
READ_KEPT = 2


def _files_now(data) -> tuple | None:
    """(path, checksum) of every file of every source (a `datasets` directory's, each; the checksum, not the
    time, which a rewrite within a few ms keeps: 0.1 s for 1M rows); None where one cannot be read (read_source
    names it)."""
    from toolkit.store.checksum import checksum_of

    out = []
    try:
        for source in data.sources:
            path = Path(source.path)
            for p in sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]:
                out.append((str(p), checksum_of(p)))
    except OSError:
        return None
    return tuple(out)


class StageData:
    def __init__(self, data, stage: str, kind: str, seed: int):
        """`data`: a DataSection; `stage`: sft, rm or rl (the part of data.split it uses); `kind`: the
        examples it needs: prompt, sft, pair or text (see data/examples.py)."""
        self.stage, self.kind = stage, kind
        files = _files_now(data)
        key = (data.model_dump_json(), stage, kind, seed, files)
        read = READ.get(key) if files is not None else None
        if read is None:
            read = self._read(data, stage, kind, seed)
            if files is not None:
                READ[key] = read
                for old in list(READ)[:-READ_KEPT]:
                    del READ[old]
        self.train, self.eval, weights = read
        self.blend = Blend([len(t) for t in self.train], weights, data.shuffle, seed)

    @staticmethod
    def _read(data, stage: str, kind: str, seed: int) -> tuple[list[list[Example]], list[Example], list[float]]:
        """(train examples per source, eval examples, the sources' weights)."""
        train: list[list[Example]] = []   # per source
        evals: list[Example] = []
        fractions = data.split.fractions() if data.split else None
        hash_seed = data.split.seed if data.split else seed
        offset, weights = 0, []
        for source in data.sources:
            rows = read_source(source.path, source.format)
            if fractions is not None and source.part not in (None, stage):  # (another stage's own rows)
                offset += rows[-1].index + 1
                continue
            kept = []
            for row in rows:
                prompt = _prompt_example(row, kind, data, offset + row.index)
                u_part, u_eval = uniforms({"prompt": prompt.prompt} if prompt else row.data, hash_seed)
                if fractions is not None and (source.part or part_of(u_part, fractions)) != stage:
                    continue
                example = prompt if kind == "prompt" and prompt else example_of(row, kind, data, offset + row.index)
                (evals if u_eval < data.eval_fraction else kept).append(example)
            offset += rows[-1].index + 1
            if not kept:
                given = (f"its part is {stage}" if fractions is not None and source.part else
                         f"data.split gives it {fractions[stage] if fractions else 1:.0%} of the rows")
                raise ConfigError(f"{source.path}: none of its {len(rows)} rows is left for training the {stage} "
                                  f"stage ({given}, data.eval_fraction holds out {data.eval_fraction:.0%}); use "
                                  "more rows or change the split")
            train.append(kept)
            weights.append(source.weight)
        if not train:
            raise ConfigError(f"data.sources: every source is another stage's (data.sources[].part), none the "
                              f"{stage} stage's; give it a source whose part is {stage} or none")
        return train, evals, weights

    @property
    def train_rows(self) -> int:
        return sum(len(t) for t in self.train)

    def next(self, n: int) -> list[Example]:
        """The next `n` training examples of the blended order."""
        return [self.train[source][index] for source, index in self.blend.next(n)]

    def skip(self, draws: int) -> None:
        """Go to the cursor after `draws` training examples from the start."""
        self.blend.skip(draws)


def _prompt_example(row, kind: str, data, id: int):
    """The row's prompt example, which decides its part of the split and whether it is held out (its prompt
    hashed: every row of a prompt goes to one part, as several responses or pairs per prompt are common,
    and a held-out prompt is trained on by no row; with the whole row hashed, the tiny set's 256 prompt rows,
    90 prompts, put held-out prompts in training too); None where the row has none (PTX text), and then
    the whole row decides. An RL stage's example is this one."""
    if kind == "text":
        return None
    try:
        return example_of(row, "prompt", data, id)
    except ConfigError:  # (a row this stage cannot read: named when its example is made, if it is kept)
        return None


KIND = {"sft": "sft", "rm": "pair", "rl": "prompt"}  # the examples each stage trains on


def check_data(cfg) -> StageData:
    """Read a stage config's data as its workers will (a bad row is a ConfigError before any process starts), and
    check that the reward functions can be called with the RL rows' fields."""
    data = StageData(cfg.data, cfg.stage, KIND[cfg.stage], cfg.run.seed)
    _check_chat_template(cfg, data)
    if cfg.stage == "rl":
        from toolkit.rewards.calls import check_calls

        if cfg.eval.every_steps:
            _check_held_out(cfg, len(data.eval))
        examples = [e for part in data.train for e in part] + data.eval
        check_fields(examples)
        check_calls(cfg.reward.functions, examples)
    ptx = getattr(cfg, "ptx", None)
    if ptx is not None and ptx.coef:
        StageData(ptx.data, "ptx", "text", cfg.run.seed)
    return data


def _check_chat_template(cfg, data: StageData) -> None:
    """Prompts of chat messages (or text with data.chat_template) need a tokenizer with a chat template that
    renders them: the workers found out at their first step, after start-up or a wait in the queue, and a
    template that refuses some rows (Gemma's and Mistral's refuse a system message, or turns that do not
    alternate) failed training at the step that drew such a row, naming none. Each sequence of roles is
    rendered once here, as the workers render prompts. So do the tokenizers of an RL run's reward models whose
    vocabulary is not the actor's (the scorer renders the prompt again with those)."""
    from toolkit.config.model_files import has_chat_template

    examples = [e for part in [*data.train, data.eval] for e in part]
    chat = next((e for e in examples if isinstance(e.prompt, list)), None)
    if chat is None and not cfg.data.chat_template:
        return
    shapes = {}  # (one prompt of each sequence of roles: what a template's checks look at)
    for e in examples:
        if isinstance(e.prompt, list) or cfg.data.chat_template:
            shapes.setdefault(tuple(m["role"] for m in e.prompt) if isinstance(e.prompt, list) else ("user",), e)
    what = f"{chat.location}: a prompt of chat messages" if chat else "data.chat_template: true"
    actor = _render_all(cfg.tokenizer_path, shapes, what, "give text prompts (and data.chat_template: false), or a "
                        "tokenizer that has one (model.tokenizer)", "model.tokenizer")
    reward = getattr(cfg, "reward", None)
    for i, rm in enumerate(reward.models if actor is not None and reward is not None else []):
        own = _tokenizer(rm.path) if has_chat_template(rm.path) is not None else None
        if own is None or own.get_vocab() == actor.get_vocab():
            continue  # (the same vocabulary: the scorer reads the generated tokens themselves)
        _render_all(rm.path, shapes, f"{what}, and reward.models.{i} has a vocabulary of its own (it renders "
                    "the prompt itself)", f"give text prompts, or a reward model whose tokenizer has one "
                    f"(reward.models.{i}.path)", f"reward.models.{i}.path", own)


def _render_all(path, shapes: dict, what: str, fix: str, setting: str, tokenizer=None):
    """The tokenizer at `path` (None where it is not there yet: a model an earlier stage of a pipeline writes),
    after rendering each prompt of `shapes` with its chat template; ConfigError naming the row it cannot render.
    `tokenizer`: that tokenizer, where the caller has loaded it already (a load takes 1-2 s)."""
    from toolkit.config.model_files import has_chat_template

    found = has_chat_template(path)
    if found is None:
        return None
    if found is False:
        raise ConfigError(f"{what}, and the tokenizer {path} has no chat template to render it with; {fix}")
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(path)
    for e in shapes.values() if tokenizer is not None else []:
        messages = e.prompt if isinstance(e.prompt, list) else [{"role": "user", "content": e.prompt}]
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # (jinja2's TemplateError of the template's raise_exception, or its own bugs)
            roles = ", ".join(m["role"] for m in messages)
            raise ConfigError(f"{e.location}: the chat template of the tokenizer {path} cannot render this prompt "
                              f"of messages ({roles}): {type(error).__name__}: {error}; convert such rows (e.g. join "
                              f"a system message to the first user message), or give a tokenizer whose template "
                              f"takes them ({setting})") from None
    return tokenizer


def _tokenizer(path):
    """The tokenizer at `path` to render chat templates with; None where it does not load here (the workers
    load it their own way, and name what is wrong)."""
    from toolkit.data.tokens import counting_tokenizer

    try:
        return counting_tokenizer(path)
    except Exception:
        return None


def _check_held_out(cfg, held_out: int) -> None:
    """An RL run that evaluates itself has a held-out prompt to evaluate on, and one for each trainer rank
    that generates where those ranks score the evaluations with the reward models together."""
    if not held_out:
        raise ConfigError(f"eval.every_steps: none of the run's prompts fell in the share held out of training "
                          f"(data.eval_fraction {cfg.data.eval_fraction:g}); raise data.eval_fraction, or set "
                          "eval.every_steps: 0")
    generators = cfg.placement.group_with("generation").workers
    if cfg.evaluation_on_trainer_ranks and cfg.placement.generation_with_actor() and held_out < generators:
        raise ConfigError(f"eval.every_steps: {held_out} prompt(s) fell in the share held out of training "
                          f"(data.eval_fraction {cfg.data.eval_fraction:g}), fewer than the {generators} trainer "
                          "ranks that generate them and score them with the reward models together, each its share; "
                          "raise data.eval_fraction, or set eval.every_steps: 0")
