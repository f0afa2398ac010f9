// The anchor for kvfork on a GPU: llama.cpp's own API driven by hand, the loop a user writes
// without kvfork. One prompt prefilled on sequence 0, copied to N-1 more (unified KV), then
// `steps` greedy steps of N tokens in one llama_decode each, the argmax read on the host
// (`host`) or taken by llama.cpp's greedy sampler on the backend (`gpu`: only token ids come
// back). Context set up as kvfork's (n_batch = n_ubatch = 512, unified KV, swa_full); best of
// 3 runs. Built and run by scripts/gpu_check/stage_bench.sh against the release wheel's own
// llama.cpp libraries, with the backend modules loaded from KVFORK_BARE_MODULE_DIRS (':'
// separated; the wheel's kvfork/ggml and the kvfork_cuda package), as kvfork loads them.
// usage: bare_bench MODEL NGL STEPS N1,N2,... [gpu|host]   prints "bare N=.. tok/s=.." lines.
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

static int argmax(const float *l, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (l[i] > l[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: %s MODEL NGL STEPS N1,N2\n", argv[0]); return 2; }
    const char *path = argv[1];
    int ngl = atoi(argv[2]), steps = atoi(argv[3]);
    bool gpu_sample = argc > 5 && std::string(argv[5]) == "gpu";
    std::vector<int> ns;
    { std::stringstream ss(argv[4]); std::string t; while (std::getline(ss, t, ',')) ns.push_back(atoi(t.c_str())); }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    if (const char *dirs = getenv("KVFORK_BARE_MODULE_DIRS")) {
        std::stringstream ds(dirs); std::string d;
        while (std::getline(ds, d, ':')) if (!d.empty()) ggml_backend_load_all_from_path(d.c_str());
    } else {
        ggml_backend_load_all();
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        fprintf(stderr, "device %zu: %s (%s)\n", i, ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    const char *prompt = "The history of the printing press begins with";
    std::vector<llama_token> ptoks(64);
    int np = llama_tokenize(vocab, prompt, strlen(prompt), ptoks.data(), 64, true, false);
    ptoks.resize(np);
    for (int n : ns) {
        llama_context_params cp = llama_context_default_params();
        // a cell per sequence per step (each repeat starts again after the prompt)
        cp.n_ctx = std::max(8192, n * steps + 1024); cp.n_batch = 512; cp.n_ubatch = 512;
        cp.n_seq_max = n; cp.n_outputs_max = n > 512 ? n : 512;
        cp.kv_unified = true; cp.swa_full = true; cp.no_perf = true;
        std::vector<llama_sampler *> chains;
        std::vector<llama_sampler_seq_config> cfg;
        if (gpu_sample) {  // greedy on the backend: only token ids come back
            for (int s = 0; s < n; s++) {
                llama_sampler *c = llama_sampler_chain_init(llama_sampler_chain_default_params());
                llama_sampler_chain_add(c, llama_sampler_init_greedy());
                chains.push_back(c);
                cfg.push_back({s, c});
            }
            cp.samplers = cfg.data(); cp.n_samplers = cfg.size();
        }
        llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "ctx failed\n"); return 1; }
        llama_batch b = llama_batch_init(512, 0, 1);
        b.n_tokens = np;
        for (int i = 0; i < np; i++) {
            b.token[i] = ptoks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = i == np - 1;
        }
        if (llama_decode(ctx, b)) { fprintf(stderr, "prefill failed\n"); return 1; }
        llama_token first = gpu_sample ? llama_get_sampled_token_ith(ctx, np - 1)
                                       : argmax(llama_get_logits_ith(ctx, np - 1), n_vocab);
        llama_memory_t mem = llama_get_memory(ctx);
        for (int s = 1; s < n; s++) llama_memory_seq_cp(mem, 0, s, -1, -1);
        std::vector<llama_token> cur(n, first);
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            // each repeat starts again right after the prompt
            for (int s = 0; s < n; s++) llama_memory_seq_rm(mem, s, np, -1);
            for (int s = 0; s < n; s++) cur[s] = first;
            auto t0 = std::chrono::steady_clock::now();
            for (int st = 0; st < steps; st++) {
                b.n_tokens = n;
                for (int s = 0; s < n; s++) {
                    b.token[s] = cur[s]; b.pos[s] = np + st; b.n_seq_id[s] = 1; b.seq_id[s][0] = s; b.logits[s] = 1;
                }
                if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
                for (int s = 0; s < n; s++)
                    cur[s] = gpu_sample ? llama_get_sampled_token_ith(ctx, s) : argmax(llama_get_logits_ith(ctx, s), n_vocab);
            }
            double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (dt < best) best = dt;
        }
        printf("bare%s N=%d tok/s=%.1f step_ms=%.3f\n", gpu_sample ? "-gpusample" : "", n, n * steps / best, 1000.0 * best / steps);
        fflush(stdout);
        llama_batch_free(b);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
