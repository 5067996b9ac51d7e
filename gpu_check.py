import sys, time, tempfile
import torch
sys.path.insert(0, "tests")
from twinkled.engine.tiny import build_tiny_model
from twinkled.engine.engine import Engine
from twinkled.engine.packed import grouped_mm, _grouped_ok
from twinkled.engine.types import LoraConfig, AdamParams
from helpers import ce_request, randomize_b

# 1. grouped_mm on the GPU: transposed weights, empty groups
x = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
offs = torch.tensor([10, 10, 30, 40], device="cuda", dtype=torch.int32)
print("grouped ok", _grouped_ok(x, w.transpose(1, 2)))
try:
    y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    ref = torch.cat([x[:10] @ w[0].T, x[10:10] @ w[1].T, x[10:30] @ w[2].T, x[30:] @ w[3].T])
    print("grouped_mm transposed/empty: max err", (y.float() - ref.float()).abs().max().item())
except RuntimeError as e:
    print("grouped_mm refused:", e)

# 2. bf16 engine on cuda vs fp32 cpu
d = build_tiny_model(tempfile.mkdtemp() + "/m", arch="qwen3_moe")
def eng(dev, dtype):
    e = Engine(d, device=dev, dtype=dtype)
    e.add_adapter("a", LoraConfig(rank=8, seed=1)); randomize_b(e, "a", 2, 0.1)
    e.add_adapter("b", LoraConfig(rank=16, seed=3)); randomize_b(e, "b", 4, 0.1)
    return e
gen = torch.Generator().manual_seed(0)
reqs = [ce_request("a", gen, 1024, [64, 30]), ce_request("b", gen, 1024, [50])]
lc = [r.metrics["loss:sum"] for r in eng("cpu", "float32").forward_backward(reqs)]
lg = [r.metrics["loss:sum"] for r in eng("cuda", "bfloat16").forward_backward(reqs)]
print("loss cpu fp32", lc, "cuda bf16", lg)

# 3. a Qwen3-30B-A3B-shape slice through the engine: 8 adapters x 1 x 512
from transformers import Qwen3MoeConfig, AutoModelForCausalLM
from twinkled.engine.tiny import build_tokenizer
L = int(sys.argv[1]) if len(sys.argv) > 1 else 4
out = tempfile.mkdtemp() + "/big"
cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=L, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
m.save_pretrained(out); build_tokenizer(out); del m; torch.cuda.empty_cache()
e = Engine(out, device="cuda", dtype="bfloat16")
for i in range(8):
    e.add_adapter(f"t{i}", LoraConfig(rank=8, seed=i))
gen = torch.Generator().manual_seed(0)
reqs = [ce_request(f"t{i}", gen, 1000, [512]) for i in range(8)]
torch.cuda.reset_peak_memory_stats()
for it in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    e.forward_backward(reqs)
    e.optim_steps([(f"t{i}", AdamParams()) for i in range(8)])
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"{L} layers step {it}: {dt*1e3:.0f} ms, {8*512/dt:,.0f} tokens/s")
print("peak GiB", torch.cuda.max_memory_allocated() / 2**30)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    e.forward_backward(reqs); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
