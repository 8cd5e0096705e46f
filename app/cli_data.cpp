// Data and tokenizer flags.
#include "app/flags.h"

namespace mt::cli {

void add_data_flags(FlagTable& t) {
  t.set_group(FlagGroup::data);
  t.value("--data-path", "dataset prefixes, optionally weighted: PREFIX or W1 PREFIX1 W2 PREFIX2 ...",
          MT_FIELD(data.data_path))
      .arity = Arity::zero_or_more;
  t.value("--split", "train,valid,test proportions, e.g. 949,50,1", MT_FIELD(data.split));
  t.value("--train-data-path", "blend for the training split only", MT_FIELD(data.train_data_path)).arity =
      Arity::zero_or_more;
  t.value("--valid-data-path", "blend for the validation split only", MT_FIELD(data.valid_data_path)).arity =
      Arity::zero_or_more;
  t.value("--test-data-path", "blend for the test split only", MT_FIELD(data.test_data_path)).arity = Arity::zero_or_more;
  t.value("--data-args-path", "a file holding --data-path's value (whitespace-separated weights and prefixes)",
          MT_FIELD(data.data_args_path));
  t.value("--per-split-data-args-path",
          "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...}, each a blend as a string or a list (or null)",
          MT_FIELD(data.per_split_data_args_path));
  t.flag("--mock-data", "synthetic data (no dataset files)", MT_FIELD(data.mock_data));
  t.value("--data-cache-path", "where the dataset index caches go", MT_FIELD(data.data_cache_path));
  t.negative_flag("--no-mmap-bin-files", "read .bin files with reads instead of mmap", MT_FIELD(data.mmap_bin_files));
  t.value("--num-workers",
          "Megatron's DataLoader workers: megatrain stages batches with one background thread per rank; with "
          "--fim-data, micro-batch k draws from FIM random stream k mod max(1, N), as Megatron's workers each draw "
          "from their own copy of the dataset's RandomState",
          MT_FIELD(data.num_workers));
  t.value("--num-dataset-builder-threads", "threads building dataset indices", MT_FIELD(data.num_dataset_builder_threads));
  t.value("--mid-level-dataset-surplus", "extra samples per blended component", MT_FIELD(data.mid_level_dataset_surplus));
  t.flag("--reset-position-ids", "restart position ids after each end of document", MT_FIELD(data.reset_position_ids));
  t.flag("--reset-attention-mask", "no attention across end of document", MT_FIELD(data.reset_attention_mask));
  t.flag("--eod-mask-loss", "no loss on end-of-document tokens", MT_FIELD(data.eod_mask_loss));
  t.flag("--dataloader-inter-document-masking",
         "attention within each document a sample was cut from, positions restarted per document (the data loader's "
         "document boundaries rather than EOD tokens)",
         MT_FIELD(data.inter_document_masking));
  t.negative_alias(t.no_effect("--no-create-attention-mask-in-dataloader", Arity::none,
                               "megatrain never materialises an s x s attention mask"));
  t.flag("--fim-data", "fill-in-the-middle samples (Megatron's GPTFIMDataset; GPT2BPETokenizer)", MT_FIELD(data.fim_data));
  t.value("--fim-rate", "probability to convert a training sample into a FIM format", MT_FIELD(data.fim_rate));
  t.value("--fim-spm-rate", "probability that a FIM sample uses the SPM format over the PSM format",
          MT_FIELD(data.fim_spm_rate));
  t.value("--fim-split-sample", "token around which to split the sample for FIM", MT_FIELD(data.fim_split_sample));
  t.value("--fim-fragment-rate", "rate of FIM on each fragment when --fim-split-sample is given",
          MT_FIELD(data.fim_fragment_rate));
  t.value("--fim-no-prefix", "do not apply FIM to fragments that start with this prefix", MT_FIELD(data.fim_no_prefix));
  t.value("--fim-prefix-token", "FIM prefix token", MT_FIELD(data.fim_prefix_token));
  t.value("--fim-middle-token", "FIM middle token", MT_FIELD(data.fim_middle_token));
  t.value("--fim-suffix-token", "FIM suffix token", MT_FIELD(data.fim_suffix_token));
  t.value("--fim-pad-token", "FIM PAD token", MT_FIELD(data.fim_pad_token));
  t.value("--fim-eod-token", "FIM EOD token", MT_FIELD(data.fim_eod_token));
  t.removed("--data-impl", Arity::one,
            "--data-impl was removed from Megatron-LM (indexed datasets are always the memory-mapped MMIDIDX "
            "format): delete it");
}

void add_tokenizer_flags(FlagTable& t) {
  t.set_group(FlagGroup::tokenizer);
  t.choice("--tokenizer-type", "tokenizer (default GPT2BPETokenizer, as Megatron's GPT entry point)",
           std::vector<std::pair<std::string, std::string>>{
               {"GPT2BPETokenizer", "GPT2BPETokenizer"}, {"HuggingFaceTokenizer", "HuggingFaceTokenizer"},
               {"NullTokenizer", "NullTokenizer"}, {"BertWordPieceLowerCase", "BertWordPieceLowerCase"},
               {"BertWordPieceCase", "BertWordPieceCase"}, {"SentencePieceTokenizer", "SentencePieceTokenizer"},
               {"GPTSentencePieceTokenizer", "GPTSentencePieceTokenizer"}, {"Llama2Tokenizer", "Llama2Tokenizer"},
               {"TikTokenizer", "TikTokenizer"}, {"MultimodalTokenizer", "MultimodalTokenizer"},
               {"NullMultimodalTokenizer", "NullMultimodalTokenizer"}, {"SFTTokenizer", "SFTTokenizer"}},
           MT_FIELD(data.tokenizer_type));
  t.value("--vocab-file", "GPT-2 vocab.json", MT_FIELD(data.vocab_file));
  t.value("--merge-file", "GPT-2 merges.txt", MT_FIELD(data.merge_file));
  t.value("--tokenizer-model", "tokenizer.json (or its directory) for HuggingFaceTokenizer", MT_FIELD(data.tokenizer_model));
  t.value("--vocab-size", "vocabulary size of NullTokenizer", MT_FIELD(data.vocab_size));
  t.value("--padded-vocab-size", "explicit padded vocabulary (skips the padding rule)", MT_FIELD(data.padded_vocab_size))
      .model_setting("padded_vocab_size", CheckpointTake::if_absent)
      .model_key("")
      .not_imported();
  t.value("--vocab-extra-ids", "extra sentinel tokens (T5)", MT_FIELD(data.vocab_extra_ids));
  t.value("--tiktoken-pattern", "TikTokenizer pattern (v1, v2)", MT_FIELD(data.tiktoken_pattern));
  t.value("--tiktoken-num-special-tokens", "TikTokenizer special tokens", MT_FIELD(data.tiktoken_num_special_tokens));
  t.value("--tokenizer-special-tokens", "special tokens", MT_FIELD(data.tokenizer_special_tokens));
  t.value("--null-tokenizer-pad-id", "NullTokenizer's pad id (-1: none): labels equal to it are masked out of the loss "
          "and read as token 0", MT_FIELD(data.null_tokenizer_pad_id));
  t.flag("--allow-ambiguous-pad-tokens", "keep a pad id that equals another special token (masking those tokens "
         "out of the loss); without it such a pad id is dropped, with a warning", MT_FIELD(data.allow_ambiguous_pad_tokens));
  t.value("--null-tokenizer-eod-id", "NullTokenizer's end-of-document id (default vocab-size - 1)",
          MT_FIELD(data.null_tokenizer_eod_id));
  t.no_effect("--trust-remote-code", Arity::none, "megatrain runs no tokenizer code from a model repository");
  t.no_effect("--tokenizer-hf-no-use-fast", Arity::none, "megatrain has one tokenizer implementation per type");
  t.removed("--legacy-tokenizer", Arity::none, "--legacy-tokenizer was removed from Megatron-LM: drop it");
  t.removed("--tiktoken-special-tokens", Arity::one_or_more,
            "--tiktoken-special-tokens was renamed --tokenizer-special-tokens in Megatron-LM");
}

}  // namespace mt::cli
