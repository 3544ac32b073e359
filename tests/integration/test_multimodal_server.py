"""A real server with a tiny LLaVA: images by data URL / base64 in /generate and OpenAI chat image_url parts;
a repeated image is served from the radix cache without the vision encoder; bad image input gets a 4xx."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.integration.conftest import API_KEY, ServerHandle

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def data_url(seed: int, fmt: str = "PNG") -> str:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    from sglang_backend.runtime.models.llava import dummy_llava_config, save_dummy_llava

    model_dir = save_dummy_llava(dummy_llava_config(), str(tmp_path_factory.mktemp("llava_model")))
    handle = ServerHandle("", API_KEY, log_dir=str(tmp_path_factory.mktemp("llava_server")),
                          extra_args=["--model-path", model_dir])  # local media stays disabled (the default)
    handle.start()
    try:
        yield handle
    finally:
        orphans = handle.stop()
    assert not orphans, f"server left orphan processes {orphans}"


@pytest.fixture
def client(llava_server):
    with llava_server.client() as c:
        yield c
    llava_server.assert_pool_whole()


def encoder_calls(client) -> int:
    return client.get("/get_stats").json()["num_vision_encoder_images"]


def test_generate_repeated_image_hits_cache(client):
    client.post("/flush_cache")
    prompt = "Tell me about <image> in detail."
    first = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY, "image_data": data_url(1)})
    assert first.status_code == 200, first.text
    calls = encoder_calls(client)
    assert calls == 1
    text_prefix = len(client.post("/tokenize", json={"prompt": "Tell me about "}).json()["tokens"])
    # The same pixels as bare base64 of a JPEG would differ (lossy); as base64 of the same PNG they do not.
    same = data_url(1).split(",", 1)[1]
    again = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY, "image_data": same}).json()
    assert again["output_ids"] == first.json()["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1 > text_prefix + 16
    assert encoder_calls(client) == calls
    other = client.post("/generate", json={"text": prompt, "sampling_params": GREEDY, "image_data": data_url(2)}).json()
    assert other["meta_info"]["cached_tokens"] == text_prefix
    assert encoder_calls(client) == calls + 1
    # A batch: one image list per prompt.
    batch = client.post("/generate", json={"text": [prompt, "No image here."], "sampling_params": GREEDY,
                                           "image_data": [data_url(1), None]})
    assert batch.status_code == 200, batch.text
    assert batch.json()[0]["output_ids"] == first.json()["output_ids"]


def test_chat_image_url_parts(client, llava_server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": data_url(3)}}]}]
    oai = llava_server.openai()
    try:
        first = oai.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0)
        second = oai.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0)
    finally:
        oai.close()
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens > 16
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


@pytest.mark.parametrize("image,message", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot decode"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported format"),
    ("/etc/hostname", "local file paths are disabled"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
    ([data_url(0)] * 17, "too many images"),
])
def test_bad_images_are_4xx(client, image, message):
    r = client.post("/generate", json={"text": "<image> hi", "sampling_params": GREEDY, "image_data": image})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    if isinstance(image, str):  # the same checks behind OpenAI chat image_url parts
        chat = client.post("/v1/chat/completions", json={"model": "default", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]})
        assert chat.status_code == 400 and message in chat.json()["error"]["message"], chat.text


def test_image_to_text_only_model(http):
    r = http.post("/generate", json={"text": "hi", "sampling_params": GREEDY, "image_data": data_url(0)})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
    chat = http.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(0)}}]}]})
    assert chat.status_code == 400 and "takes no images" in chat.json()["error"]["message"]


def test_dsl_over_http_sends_local_images_and_video_frames(llava_server, client, tmp_path):
    """The server does not read client files: the DSL's endpoint backend sends them as data URLs."""
    from PIL import Image

    from sglang_backend import RuntimeEndpoint, function, gen, image, video
    from tests.unit.test_llava import write_video

    path = str(tmp_path / "pic.png")
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)
    clip = str(tmp_path / "clip.mp4")
    write_video(clip)

    @function
    def ask(s, media):
        s += "Look: " + media + " Answer:" + gen("a", max_tokens=4, temperature=0)

    backend = RuntimeEndpoint(llava_server.url, api_key=API_KEY)
    first = ask.run(media=image(path), backend=backend)
    again = ask.run(media=image(path), backend=backend)
    assert again["a"] == first["a"]
    assert again.get_meta_info("a")["cached_tokens"] == again.get_meta_info("a")["prompt_tokens"] - 1
    frames = ask.run(media=video(clip, 3), backend=backend)
    assert frames.get_meta_info("a")["prompt_tokens"] > 3 * 16
