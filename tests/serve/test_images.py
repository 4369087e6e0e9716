"""Images through `k3 serve` (issue 32): OpenAI `image_url` parts with base64 data URIs (PNG / JPEG / WebP) are
decoded, preprocessed and placed as the multimodal model's prompt embeddings; the answer equals
k3.multimodal.generate's. Remote URLs are refused (the server never fetches), too many / too large images are
refused naming the field, and a corrupt image fails its request alone while normal requests complete."""
import base64
import io
import threading

import httpx
import pytest
import torch

from .conftest import start_server, tiny_config


def _png(size=(40, 30), colour=(200, 30, 30), fmt="PNG") -> bytes:
    from PIL import Image
    img = Image.new("RGB", size, colour)
    img.paste((20, 200, 40), (0, 0, size[0] // 2, size[1] // 2))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def mm_loaded(tmp_path_factory):
    from k3.generation.cli import load_for_inference
    from k3.multimodal import K3ForConditionalGeneration, multimodal_config
    from k3.tokenizer import build_toy_tokenizer
    root = tmp_path_factory.mktemp("serve_mm")
    tok = build_toy_tokenizer(str(root / "tok"), num_merges=100)
    cfg = multimodal_config(tiny_config(tok), "tiny", media_placeholder_token_id=tok.token_to_id("<|media_pad|>"))
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # sharper outputs: answers depend on the image
        model.language_model.lm_head.weight.normal_(0, 1.0)
    d = str(root / "k3-mm")
    model.save_pretrained(d, tokenizer=tok)
    return load_for_inference(d, "cpu")


@pytest.fixture(scope="module")
def mm_server(mm_loaded):
    s = start_server(mm_loaded, max_batch=4, max_queue=16, default_max_tokens=6, max_context=256, max_images=2,
                     max_image_bytes=20000)
    yield s
    s.close()


def _chat(parts, **kw):
    return {"model": "k3-test", "messages": [{"role": "user", "content": parts}], "max_tokens": 6,
            "temperature": 0, **kw}


def _reference(loaded, parts, images):
    from PIL import Image
    from k3.chat import K3ChatFormat
    from k3.multimodal import generate
    model, tok = loaded
    pil = [Image.open(io.BytesIO(b)) for b in images]
    it = iter(pil)
    content = []
    for p in parts:
        if p["type"] == "text":
            content.append(p)
        else:
            im = next(it)
            content.append({"type": "image", "width": im.size[0], "height": im.size[1]})
    ids = K3ChatFormat(tok).render([{"role": "user", "content": content}], thinking=False,
                                   add_generation_prompt=True)
    out = generate(model, ids, pil, 6, stop_token_ids=[tok.eos_id], return_dict=True)
    new = out.new_tokens[0]
    k = next((j for j, t in enumerate(new) if tok.is_special(t)), len(new))
    return tok.decode(new[:k])


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_data_uri_image_answer_matches_generate(mm_server, mm_loaded, fmt, mime):
    data = _png(fmt=fmt)
    parts = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": _uri(data, mime)}},
             {"type": "text", "text": "what is it?"}]
    r = httpx.post(mm_server.base + "/v1/chat/completions", json=_chat(parts), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == _reference(mm_loaded, parts, [data])
    # the image changes the prompt (tokens of the expanded prompt are counted)
    assert r.json()["usage"]["prompt_tokens"] > 12


def _err(r, status, param=None, code=None, text=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    if param is not None:
        assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    if text is not None:
        assert text in e["message"], e
    return e


def test_refused_images(mm_server):
    post = lambda body: httpx.post(mm_server.base + "/v1/chat/completions", json=body, timeout=60)  # noqa: E731
    url = "messages[0].content[0].image_url.url"
    _err(post(_chat([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])), 400, url,
         "unsupported_value", "not fetched")
    _err(post(_chat([{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.jpg"}}])), 400, url)
    _err(post(_chat([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}])), 400, url)
    _err(post(_chat([{"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGODlh"}}])), 400, url,
         "unsupported_value", "image/gif")
    _err(post(_chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])), 400, url,
         text="base64")
    _err(post(_chat([{"type": "image_url", "image_url": {}}])), 400)
    _err(post(_chat([{"type": "image_url"}])), 400, "messages[0].content[0].image_url")
    # corrupt / truncated / mislabelled bytes: the part is named
    _err(post(_chat([{"type": "image_url", "image_url": {"url": _uri(b"not an image at all")}}])), 400, url,
         "invalid_image")
    _err(post(_chat([{"type": "image_url", "image_url": {"url": _uri(_png()[:60])}}])), 400, url, "invalid_image")
    # limits: 3 images > max_images=2 (the third is named); > max_image_bytes in total: 413
    img = {"type": "image_url", "image_url": {"url": _uri(_png())}}
    _err(post(_chat([img, img, img])), 400, "messages[0].content[2].image_url.url", "too_many_images")
    big = _png(size=(400, 300), colour=(1, 2, 3), fmt="BMP")
    assert len(big) > 20000
    _err(post(_chat([{"type": "image_url", "image_url": {"url": _uri(big, "image/png")}}])), 413, "messages",
         "images_too_large")
    # images only in user messages
    r = post({"model": "k3-test", "max_tokens": 2, "messages": [
        {"role": "system", "content": [img]}, {"role": "user", "content": "hi"}]})
    _err(r, 400, "messages[0].content[0].type")
    assert httpx.get(mm_server.base + "/health", timeout=10).status_code == 200


def test_text_only_server_refuses_images(server):
    body = _chat([{"type": "image_url", "image_url": {"url": _uri(_png())}}])
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
    _err(r, 400, "messages[0].content[0].image_url.url", "unsupported_value", "text-only")


def test_corrupt_image_fails_alone(mm_server, mm_loaded):
    """Good image requests, text requests and corrupt-image requests at once: every good one gets its own
    answer, every corrupt one a 400."""
    good = [{"type": "image_url", "image_url": {"url": _uri(_png(colour=(10 * i, 90, 200)))}} for i in range(3)]
    jobs = []
    for i in range(3):
        jobs.append(("good", _chat([good[i], {"type": "text", "text": f"q{i}"}])))
        jobs.append(("text", _chat([{"type": "text", "text": f"hello {i}"}])))
        jobs.append(("bad", _chat([{"type": "image_url", "image_url": {"url": _uri(b"\x89PNG\r\n\x1a\n" + b"0" * 50)}}])))
    results = [None] * len(jobs)

    def go(i):
        results[i] = httpx.post(mm_server.base + "/v1/chat/completions", json=jobs[i][1], timeout=120)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (kind, body), r in zip(jobs, results):
        if kind == "bad":
            _err(r, 400, "messages[0].content[0].image_url.url", "invalid_image")
            continue
        assert r.status_code == 200, r.text
        parts = body["messages"][0]["content"]
        imgs = [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts if p["type"] == "image_url"]
        assert r.json()["choices"][0]["message"]["content"] == _reference(mm_loaded, parts, imgs)
