"""Sequential recommendation: interaction logs, leave-one-out, SASRec and BERT4Rec."""
