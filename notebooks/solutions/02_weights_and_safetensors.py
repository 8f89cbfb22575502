# Solutions to notebook 02. Run from the notebook (uses ckpt, L, json, struct, torch, tempfile).
# 1. A safetensors writer (fp32 only, for brevity).
def write_safetensors(tensors, out):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        b = t.detach().float().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


from safetensors.torch import load_file
small = {k: v for k, v in list(ckpt.tensors.items())[:5]}
out = Path(tempfile.mkdtemp()) / "mine.safetensors"
write_safetensors(small, out)
back = load_file(str(out))
assert all(torch.equal(back[k], v.float()) for k, v in small.items())
print("the library reads our file back")

# 2. Sizes of Llama-3.2-1B.
from pagedlab import LLAMA_3_2_1B as L
n = L.num_parameters()
for name, bits in (("fp32", 32), ("bf16", 16), ("4-bit", 4)):
    print(f"{name:6} {n * bits / 8 / 1e9:5.2f} GB = {n * bits / 8 / 141e9:.1%} of an H200")
