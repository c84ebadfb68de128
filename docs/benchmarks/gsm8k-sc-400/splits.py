import json, statistics as st
recs = [json.loads(line) for line in open("docs/benchmarks/gsm8k-sc-400/results.jsonl")]
for lo, hi in [(0, 294), (294, 400), (100, 400), (369, 400)]:
    for m in ["ar", "smc-n8-k2", "ar-greedy", "ar-sc-n4", "smc-n8-k2-reward-vote"]:
        rs = [r for r in recs if r["method"] == m and lo <= int(r["prompt_id"].split("-")[1]) < hi]
        print(f"q {lo}-{hi - 1} {m}: right {100 * st.mean(r['correct'] for r in rs):.1f}%, "
              f"mean s/answer {st.mean(r['seconds'] for r in rs):.1f}, "
              f"median tokens/s {st.median(r['tokens_per_second'] for r in rs):.1f}")
