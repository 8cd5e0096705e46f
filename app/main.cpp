// megatrain: pretrain GPT- and Llama-style transformers from Megatron-LM's command line.
#include <cstdio>
#include <cstring>

#include "app/preprocess_data.h"
#include "app/version.h"

#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
    std::printf("megatrain %s\n", mt::version_string());
    return 0;
  }
  // Minimal dispatch until the subcommand table (branch cli) takes over.
  if (argc > 1 && std::strcmp(argv[1], "preprocess-data") == 0)
    return mt::preprocess_data_main(std::vector<std::string>(argv + 2, argv + argc));
  std::fprintf(stderr, "megatrain: the command line is not wired up yet\n");
  return 1;
}
