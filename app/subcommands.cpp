#include "app/subcommands.h"

#include "app/export_megatron.h"
#include "app/hf_commands.h"
#include "app/import_megatron.h"
#include "app/inspect_data.h"
#include "app/preprocess_data.h"

namespace mt {

const std::vector<Subcommand>& subcommands() {
  // One line per subcommand: {"name", "summary", &function}. Declare the function in your
  // component's header (e.g. data/preprocess.h) and include it above.
  static const std::vector<Subcommand> table = {
      {"preprocess-data", "tokenize a JSONL corpus into Megatron's .bin/.idx (tools/preprocess_data.py's flags)",
       &preprocess_data_main},
      {"inspect-data", "print the token windows training would read: <training flags> --num-samples N "
                       "[--split-name train|valid|test]",
       &inspect_data_main},
      {"export-hf", "write a checkpoint as a Hugging Face model: --load CKPT --output DIR [--ckpt-step N] "
                    "[--max-shard-size BYTES]",
       &export_hf_main},
      {"import-hf", "write a Hugging Face GPT-2/Llama model as a megatrain checkpoint: --hf-dir DIR --save CKPT "
                    "[--make-vocab-size-divisible-by N] [--tensor-model-parallel-size N]",
       &import_hf_main},
      {"import-megatron", "write a Megatron-LM checkpoint (torch, torch_dist, or FSDP's fsdp_dtensor or torch_dcp format, with its "
                          "optimizer state) as a megatrain checkpoint: "
                          "--load DIR --save CKPT [--ckpt-step N] [--weights-only]",
       &import_megatron_main},
      {"export-megatron", "write a checkpoint as a Megatron-LM checkpoint (torch, torch_dist or fsdp_dtensor format, with its "
                          "optimizer state) that pretrain_gpt.py --transformer-impl local continues from: --load CKPT "
                          "--save DIR [--ckpt-format torch_dist|torch|fsdp_dtensor] [--ckpt-step N] "
                          "[--tensor-model-parallel-size T] [--pipeline-model-parallel-size P] "
                          "[--use-distributed-optimizer] [--weights-only]",
       &export_megatron_main},
      {"forward-logits", "dump one sequence's logits (.npy) for checks: --load CKPT --tokens 1,2,3 --output FILE "
                         "[--device cpu|gpu]",
       &forward_logits_main},
  };
  return table;
}

const Subcommand* find_subcommand(const std::string& name) {
  for (const Subcommand& s : subcommands())
    if (name == s.name) return &s;
  return nullptr;
}

}  // namespace mt
