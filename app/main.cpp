// megatrain: pretrain GPT- and Llama-style transformers from Megatron-LM's command line.
#include <cstdio>
#include <cstring>

#include "app/version.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
    std::printf("megatrain %s\n", mt::version_string());
    return 0;
  }
  std::fprintf(stderr, "megatrain: the command line is not wired up yet\n");
  return 1;
}
