"""Sequential recommendation (SASRec, BERT4Rec): not yet implemented, see the issues."""
