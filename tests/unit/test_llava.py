"""LLaVA (tiny, CPU fp32): greedy outputs equal HF transformers' LlavaForConditionalGeneration token for token;
image-hash radix keys reuse a repeated image's KV and skip the vision encoder; bad image input is a ValueError."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from tests.conftest import make_engine

NEW_TOKENS = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS}


def make_image(seed: int, size=(48, 40)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> str:
    from sglang_backend.runtime.models.llava import dummy_llava_config, save_dummy_llava

    return save_dummy_llava(dummy_llava_config(), str(tmp_path_factory.mktemp("tiny_llava")), seed=0)


@pytest.fixture(scope="module")
def llava_engine(llava_dir):
    engine = make_engine(llava_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chunked_engine(llava_dir):
    """Prefill in chunks of 8 tokens: every 16-token image span is split across two extends."""
    engine = make_engine(llava_dir, chunked_prefill_size=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _pool_whole(request):
    yield
    for name in ("llava_engine", "chunked_engine"):
        if name in request.fixturenames:
            request.getfixturevalue(name).check_pool_whole()


def encoder_calls(engine) -> int:
    return engine.get_stats()["num_vision_encoder_images"]


def hf_greedy(hf, engine, prompt: str, images) -> list[int]:
    """HF's greedy continuation of the same prompt: its ids carry the image token over each span."""
    proc = engine.mm_processor
    ids, mm = proc.expand(engine.tokenizer.encode(prompt), images, 10**6, 10**6)
    for it in mm.items:
        ids[it.offset : it.offset + it.length] = [proc.image_token_id] * it.length
    pixels = torch.stack([it.pixel_values for it in mm.items])
    out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      pixel_values=pixels, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


CASES = [
    ("<image>\nWhat is in the picture? The", [1]),
    ("Compare <image> with <image>: which one is brighter?", [2, 3]),
]


@pytest.mark.parametrize("prompt,seeds", CASES, ids=["1-image", "2-images"])
@pytest.mark.parametrize("which", ["llava_engine", "chunked_engine"])
def test_greedy_matches_hf(prompt, seeds, which, request, hf_llava):
    engine = request.getfixturevalue(which)
    engine.flush_cache()
    images = [make_image(s) for s in seeds]
    ours = engine.generate(prompt, GREEDY, image_data=images)
    assert ours["output_ids"] == hf_greedy(hf_llava, engine, prompt, images)
    # Batched with a text-only prompt and another image: same tokens.
    batch = engine.generate([prompt, "Hello there", prompt], GREEDY,
                            image_data=[images, None, [make_image(s + 10) for s in seeds]])
    assert batch[0]["output_ids"] == ours["output_ids"]
    assert batch[2]["output_ids"] == hf_greedy(hf_llava, engine, prompt, [make_image(s + 10) for s in seeds])


def test_image_content_changes_the_output_distribution(llava_engine):
    params = {"temperature": 0, "max_new_tokens": 1}
    a = llava_engine.generate("<image> Describe:", params, image_data=make_image(1), return_logprob=True)
    b = llava_engine.generate("<image> Describe:", params, image_data=make_image(2), return_logprob=True)
    assert a["meta_info"]["output_token_logprobs"][0][0] != b["meta_info"]["output_token_logprobs"][0][0]


def test_repeated_image_reuses_kv_and_skips_encoder(llava_engine):
    eng = llava_engine
    eng.flush_cache()
    prompt = "Question one. <image> What do you see?"
    img = make_image(5)
    first = eng.generate(prompt, GREEDY, image_data=img)
    calls = encoder_calls(eng)
    span = eng.mm_processor.num_image_tokens
    start = len(eng.tokenizer.encode("Question one. "))
    # The same pixels sent as PNG bytes, base64 and a data URL: one hash, so one cache entry.
    b64 = base64.b64encode(png_bytes(img)).decode()
    for form in (png_bytes(img), b64, "data:image/png;base64," + b64):
        again = eng.generate(prompt, GREEDY, image_data=form)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens"] >= start + span  # the image span came from the cache
        assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
        assert encoder_calls(eng) == calls


def test_different_or_near_identical_image_shares_only_text_prefix(llava_engine):
    eng = llava_engine
    eng.flush_cache()
    prompt = "Look at this: <image> and answer."
    text_prefix = len(eng.tokenizer.encode("Look at this: "))
    base = make_image(7)
    eng.generate(prompt, GREEDY, image_data=base)
    calls = encoder_calls(eng)
    near = np.array(base)
    near[0, 0, 0] ^= 1  # one bit of one pixel
    for k, other in enumerate([make_image(8), near]):
        out = eng.generate(prompt, GREEDY, image_data=other)
        assert out["meta_info"]["cached_tokens"] == text_prefix
        assert encoder_calls(eng) == calls + k + 1


def test_prefix_hit_ending_inside_image_span(llava_engine, hf_llava):
    """A prompt that ends with its image: the repeat matches all but the last position, which lies inside
    the span, so the extend needs the last feature vector only (from the feature cache)."""
    eng = llava_engine
    eng.flush_cache()
    prompt = "Final image: <image>"
    img = make_image(11)
    first = eng.generate(prompt, GREEDY, image_data=img)
    calls = encoder_calls(eng)
    again = eng.generate(prompt, GREEDY, image_data=img)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == first["output_ids"] == hf_greedy(hf_llava, eng, prompt, [img])
    assert encoder_calls(eng) == calls
    # Feature cache emptied but the tree kept: a longer prompt whose prefix covers the image skips the encoder.
    eng.scheduler.model_runner.model.feature_cache.clear()
    longer = eng.generate(prompt + " more text", GREEDY, image_data=img)
    assert longer["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"]
    assert encoder_calls(eng) == calls


def test_pad_ids_are_out_of_vocab_and_distinct():
    from sglang_backend.runtime.multimodal import pad_ids_for_hash

    a = pad_ids_for_hash("00" * 32, 64, 512)
    b = pad_ids_for_hash("00" * 31 + "01", 64, 512)
    assert min(a + b) >= 512 and len(set(a)) > 60
    assert all(x != y for x, y in zip(a, b))


def test_bad_image_inputs(llava_engine, tmp_path):
    eng = llava_engine
    cases = {
        b"definitely not an image": "cannot decode",
        "data:text/plain;base64,aGVsbG8=": "unsupported format",
        "data:image/png;base64,%%%": "invalid",
        "http://example.com/cat.png": "remote URLs are not fetched",
        str(tmp_path / "missing.png"): "not found",
        42: "expected a path",
    }
    for item, message in cases.items():
        with pytest.raises(ValueError, match=message):
            eng.generate("<image> hi", GREEDY, image_data=item)
    with pytest.raises(ValueError, match="too many images"):
        eng.generate("hi", GREEDY, image_data=[make_image(0)] * (eng.mm_processor.max_images + 1))
    with pytest.raises(ValueError, match="2 images were given"):
        eng.generate("<image> only one placeholder", GREEDY, image_data=[make_image(0), make_image(1)])
    with pytest.raises(ValueError, match="prompt logprobs"):
        eng.generate("<image> hi", GREEDY, image_data=make_image(0), return_logprob=True, logprob_start_len=0)


def test_image_to_text_only_model(tiny_engine):
    with pytest.raises(ValueError, match="takes no images"):
        tiny_engine.generate("hi", GREEDY, image_data=make_image(0))


def test_local_paths_need_permission(llava_dir, tmp_path):
    from sglang_backend.runtime.multimodal import load_image

    path = tmp_path / "img.png"
    make_image(3).save(path)
    assert load_image(str(path), allow_local_media=True).size == (48, 40)
    with pytest.raises(ValueError, match="local file paths are disabled"):
        load_image(str(path), allow_local_media=False)


def write_video(path: str, num_frames: int = 12) -> None:
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for i in range(num_frames):
            arr = np.full((32, 48, 3), 20 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_frames_and_dsl(llava_engine, tmp_path):
    import sglang_backend as sgl
    from sglang_backend.lang.backends.engine import EngineBackend
    from sglang_backend.runtime.multimodal import load_video_frames

    path = str(tmp_path / "clip.mp4")
    write_video(path)
    frames = load_video_frames(path, 4)
    means = [float(np.asarray(f).mean()) for f in frames]
    assert len(frames) == 4 and means == sorted(means) and means[-1] - means[0] > 150  # first .. last frame
    with pytest.raises(ValueError, match="not found"):
        load_video_frames(str(tmp_path / "nope.mp4"), 2)

    img_path = str(tmp_path / "pic.png")
    make_image(21).save(img_path)

    @sgl.function
    def describe(s, media, video_path):
        s += "Look: "
        s += sgl.image(media) if video_path is None else sgl.video(video_path, 3)
        s += " Answer:" + sgl.gen("answer", max_tokens=6, temperature=0)

    backend = EngineBackend(llava_engine)
    llava_engine.flush_cache()
    state = describe.run(media=img_path, video_path=None, backend=backend)
    direct = llava_engine.generate("Look: <image> Answer:", {"temperature": 0, "max_new_tokens": 6},
                                   image_data=img_path)
    assert state["answer"] == direct["text"]
    assert state.get_meta_info("answer")["cached_tokens"] == 0 and direct["meta_info"]["cached_tokens"] > 16
    video = describe.run(media=None, video_path=path, backend=backend)
    span = llava_engine.mm_processor.num_image_tokens
    assert video.get_meta_info("answer")["prompt_tokens"] > 3 * span


def test_loads_both_hf_checkpoint_layouts(llava_dir):
    """Checkpoints name weights ``language_model.model.*`` / ``vision_tower.*`` (llava-hf, and what this
    transformers saves) or ``model.language_model.*`` / ``lm_head.*`` / ``model.vision_tower.vision_model.*``
    (transformers 4.52-4.x in memory). Both load into the same parameters."""
    from transformers import AutoConfig

    from sglang_backend.runtime.model_loader.loader import iterate_weights
    from sglang_backend.runtime.models.llava import LlavaForConditionalGeneration

    def other_layout(name: str) -> str:
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower.vision_model."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    config = AutoConfig.from_pretrained(llava_dir)
    saved, other = LlavaForConditionalGeneration(config), LlavaForConditionalGeneration(config)
    weights = list(iterate_weights(llava_dir))
    saved.load_weights(weights)
    renamed = [(other_layout(n), t) for n, t in weights]
    assert {n for n, _ in renamed}.isdisjoint(n for n, _ in weights)
    other.load_weights(renamed)
    for (n1, p1), (n2, p2) in zip(saved.state_dict().items(), other.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="unexpected weight"):
        saved.load_weights([("model.something_else.weight", torch.zeros(1))])


def test_siglip_tower_matches_hf(tmp_path):
    """A SigLIP tower (no CLS vector) with the "full" strategy: all patches become image tokens."""
    from transformers import LlavaForConditionalGeneration

    from sglang_backend.runtime.models.llava import dummy_llava_config, save_dummy_llava

    path = save_dummy_llava(dummy_llava_config(vision_type="siglip", vision_feature_select_strategy="full",
                                               vision_feature_layer=[-2, -1]), str(tmp_path / "siglip"))
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path)
    try:
        assert engine.mm_processor.num_image_tokens == 16
        prompt, images = "Describe <image> and <image> briefly:", [make_image(31), make_image(32)]
        ours = engine.generate(prompt, GREEDY, image_data=images)
        assert ours["output_ids"] == hf_greedy(hf, engine, prompt, images)
        engine.check_pool_whole()
    finally:
        engine.shutdown()
